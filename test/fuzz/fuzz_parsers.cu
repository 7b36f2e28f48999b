// test/fuzz/fuzz_parsers.cu: a libFuzzer target over every parser that reads user files: JSON
// (config.json), safetensors (model and adapter files), token shards, tokenizer.bin, tokenizer.json,
// image shards, the training state (train_state.bin, for a run of 4 trainable values) and chat
// templates (tokenizer_config.json's chat_template, rendered for a fixed conversation). The
// first input byte picks the parser; the rest is the file. A parser must either accept the bytes
// or reject them through fail(); anything else (a crash, an out-of-bounds read under ASan, a hang)
// is a finding. Build and run: make fuzz (clang with libFuzzer).
#include <setjmp.h>
#include "../../llmc/common.h"
#include "../../llmc/formats/json.h"
#include "../../llmc/formats/safetensors.h"
#include "../../llmc/text/textdata.h"
#include "../../llmc/text/tokenizer.h"
#include "../../llmc/text/hf_tokenizer.h"
#include "../../llmc/vision/imagedata.h"
#include "../../llmc/train/train_state.h"
#include "../../llmc/text/chat_template.h"

static jmp_buf g_reject;
static void reject_hook(int status) { (void)status; longjmp(g_reject, 1); }  // fail() returns here

static const char* fuzz_file(const uint8_t* data, size_t size) {
    static char path[64];
    snprintf(path, sizeof(path), "/tmp/fuzz_parsers_%d.bin", (int)getpid());
    FILE* f = fopen(path, "wb");
    if (f) { fwrite(data, 1, size, f); fclose(f); }
    return path;
}

// Static so that it is still valid after fail() longjmps out of st_open and can be closed: a
// rejected file's mapping would otherwise leak at every input and end the run at libFuzzer's
// memory limit (about 50 KiB per input).
static StFile g_st;

// FUZZ_ONLY=k in the environment keeps every input on parser k (the first byte still chooses
// nothing else), so one target gets the whole run: make fuzz-chat and make fuzz-sp use it.
static int fuzz_only(void) {
    static int only = -2;
    if (only == -2) only = getenv("FUZZ_ONLY") ? atoi(getenv("FUZZ_ONLY")) : -1;
    return only;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    int which = fuzz_only() >= 0 ? fuzz_only() : data[0] % 8;
    data++; size--;
    FILE* saved_stderr = stderr;
    stderr = fopen("/dev/null", "w");  // fail() messages are expected here
    g_fail_hook = reject_hook;
    if (setjmp(g_reject) == 0) {
        switch (which) {
            case 0: { Json j = json_parse((const char*)data, size, "fuzz"); json_free(&j); break; }
            case 1: { st_open(&g_st, fuzz_file(data, size)); for (int i = 0; i < g_st.count; i++) (void)st_numel(&g_st.tensors[i]); break; }
            case 2: { TokenShard s; shard_load(&s, fuzz_file(data, size), 1000); shard_free(&s); break; }
            case 3: {
                Tokenizer t;
                tokenizer_load(&t, fuzz_file(data, size), 0);
                int ids[64];
                if (t.vocab_size > 3) { int n = tokenizer_encode(&t, "fuzz me", 1, ids); char bb[2]; for (int i = 1; i < n; i++) (void)tokenizer_decode(&t, ids[i - 1], ids[i], bb); }
                tokenizer_free(&t);
                break;
            }
            case 4: { ImageShard s; image_shard_load(&s, fuzz_file(data, size)); image_shard_free(&s); break; }
            case 5: {
                HfTokenizer t;
                hf_tokenizer_load(&t, fuzz_file(data, size));
                // a long prompt too: byte fallback makes up to 3 tokens of one byte (a buffer sized 2 per
                // byte overflowed only on prompts longer than the seeds' few words)
                static const char* prompt = "fuzz me  12 \xC3\xA9<s> \xF0\x9F\x98\x80 \xE2\x96\x81 tabs\t\tand  spaces   "
                                            "fuzz me  12 \xC3\xA9<s> \xF0\x9F\x98\x80 \xE2\x96\x81 tabs\t\tand  spaces   "
                                            "fuzz me  12 \xC3\xA9<s> \xF0\x9F\x98\x80 \xE2\x96\x81 tabs\t\tand  spaces   ";
                int n, *ids = hf_encode(&t, prompt, 1, &n);
                for (int i = 0; i < n; i++) (void)hf_decode(&t, i ? ids[i - 1] : -1, ids[i]);
                free(ids);
                hf_tokenizer_free(&t);
                break;
            }
            case 6: { StateHeader h; float p[4], m[4], v[4]; state_load(fuzz_file(data, size), &h, "fuzz", 4, p, m, v); break; }
            case 7: {
                static char* text;  // static: freed at the next input even when fail() longjmps out
                free(text);
                text = (char*)xmalloc(size + 1);
                memcpy(text, data, size);
                text[size] = 0;
                ChatMsg conv[3] = {{"system", " Be brief. "}, {"user", "Hi \xC3\xA9"}, {"assistant", "<think>\nhm\n</think>\n\nHello!"}};
                static ChatRender st;  // static: what a rejected rendering allocated is freed here, next time
                for (int agp = 0; agp < 2; agp++) {
                    chat_render_free(&st);
                    chat_template_render_into(&st, text, "fuzz", conv, 3 - agp, agp, "<s>", "</s>");
                }
                break;
            }
        }
    }
    st_close(&g_st);  // accepted or rejected (st_close of a closed file does nothing)
    g_fail_hook = NULL;
    fclose(stderr);
    stderr = saved_stderr;
    return 0;
}

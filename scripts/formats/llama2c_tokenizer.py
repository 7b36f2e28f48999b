"""The llama2.c tokenizer.bin format and its encoder/decoder.

File: int32 max_token_length, then per token: float32 score, int32 len, len bytes.
The vocabulary size is not stored; tokens run to end of file.
Encoding follows llama2.c's run.c: dummy-prefix space, one token per UTF-8
codepoint (byte fallback ids = byte + 3), then greedy merges of the adjacent pair
with the highest vocab score. The C trainer uses the same file, so the two must
agree token for token.

A tokenizer_config.json beside the file may carry a "tokenizer_bin" block
(scripts/formats/gguf_llama.py writes one): {"type": "sentencepiece" | "byte_level",
"bos_id", "eos_id", "add_bos", "special_ids", "pretokenizer"}. Byte-level (GPT-2
style BPE, pieces are raw bytes): no dummy prefix, special tokens are matched
literally in the text and never merged, the rest is split into pre-tokens (GPT-2's
regex with ASCII classes, see pretoken_end), each starts as one token per byte and
is merged the same way; decoding is the pieces' bytes, nothing stripped. In both
modes BOS is added only when add_bos says so (default true) or the text is empty.
llmc/text/tokenizer.h does exactly the same (its header comment lists the approximations).
"""
import heapq
import json
import os
import struct

BOS_ID = 1
EOS_ID = 2
BYTE_FALLBACK_OFFSET = 3  # ids 3..258 are the raw bytes <0x00>..<0xFF>


def read_tokenizer_bin(path):
    """Return (pieces: list of bytes, scores: list of float, max_token_length)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer (no max_token_length)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    pos, pieces, scores = 4, [], []
    while pos < len(data):
        if pos + 8 > len(data):
            raise ValueError(f"{path}: truncated at token {len(pieces)} (score/length)")
        score, n = struct.unpack_from("<fi", data, pos)
        pos += 8
        if n < 0 or pos + n > len(data):
            raise ValueError(f"{path}: token {len(pieces)} has bad length {n}")
        pieces.append(data[pos:pos + n])
        scores.append(score)
        pos += n
    if not pieces:
        raise ValueError(f"{path}: contains no tokens")
    return pieces, scores, max_len


def write_tokenizer_bin(path, pieces, scores):
    """Write pieces (bytes) and scores in llama2.c format, atomically."""
    if len(pieces) != len(scores):
        raise ValueError("write_tokenizer_bin: pieces and scores differ in length")
    max_len = max((len(p) for p in pieces), default=0)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<i", max_len))
            for piece, score in zip(pieces, scores):
                f.write(struct.pack("<fi", float(score), len(piece)))
                f.write(bytes(piece))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _byte_piece_value(piece):
    """Return the byte value if piece is of form b'<0xXX>', else None."""
    if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


OTHER, LETTER, DIGIT, SPACE = range(4)
PRETOKENIZERS = ("none", "gpt2", "gpt2_digits")


def byte_class(c):
    """Pre-tokenizer class of a byte: ASCII letters and every byte >= 0x80 are letters."""
    if c >= 0x80 or 0x41 <= c <= 0x5A or 0x61 <= c <= 0x7A:
        return LETTER
    if 0x30 <= c <= 0x39:
        return DIGIT
    if c == 0x20 or 0x09 <= c <= 0x0D:
        return SPACE
    return OTHER


def pretoken_end(s, i, n, digits_alone):
    """End of the pre-token at s[i] (bytes, i < n) under GPT-2's regex
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+ with ASCII classes;
    digits_alone: every digit is a piece of its own and ends the text around it."""
    if s[i] == 0x27 and i + 1 < n:  # '
        a, b = s[i + 1], s[i + 2] if i + 2 < n else 0
        if a in b"stmd":
            return i + 2
        if (a, b) in ((0x72, 0x65), (0x76, 0x65), (0x6C, 0x6C)):  # re ve ll
            return i + 3
    c = byte_class(s[i])
    if c == DIGIT and digits_alone:
        return i + 1
    j = i
    if s[i] == 0x20 and i + 1 < n:
        nc = byte_class(s[i + 1])
        if nc != SPACE and not (digits_alone and nc == DIGIT):
            j, c = i + 1, nc  # " ?" before a word, a number or punctuation
    if c != SPACE:
        while j < n and byte_class(s[j]) == c:
            j += 1
        return j
    while j < n and byte_class(s[j]) == SPACE:
        j += 1
    if j == n or (digits_alone and byte_class(s[j]) == DIGIT):
        return j
    return j - 1 if j - i > 1 else j  # \s+(?!\S) leaves the last one to what follows


def read_sidecar(path, vocab_size):
    """The "tokenizer_bin" block of tokenizer_config.json beside path, or {} (llama2.c rules)."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if not os.path.exists(cfg_path):
        return {}
    with open(cfg_path, encoding="utf-8") as f:
        try:
            block = json.load(f).get("tokenizer_bin")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{cfg_path}: not a JSON object ({e})") from None
    if block is None:
        return {}
    kind = block.get("type", "sentencepiece") if isinstance(block, dict) else None
    if kind not in ("sentencepiece", "byte_level"):
        raise ValueError(f"{cfg_path}: tokenizer_bin.type must be sentencepiece or byte_level")
    for key in ("bos_id", "eos_id"):
        v = block.get(key, 0)
        if not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{cfg_path}: tokenizer_bin.{key} {v!r} is not a token id")
    if block.get("pretokenizer", "none") not in PRETOKENIZERS:
        raise ValueError(f"{cfg_path}: tokenizer_bin.pretokenizer must be one of {PRETOKENIZERS}")
    if any(not isinstance(i, int) or not 0 <= i < vocab_size for i in block.get("special_ids", [])):
        raise ValueError(f"{cfg_path}: tokenizer_bin.special_ids holds an id outside the vocabulary")
    return block


class Tokenizer:
    def __init__(self, path):
        self.path = path
        self.pieces, self.scores, self.max_token_length = read_tokenizer_bin(path)
        self.vocab_size = len(self.pieces)
        # first id wins on duplicate pieces, like a sorted-vocab lookup would mostly do
        self.piece_to_id = {}
        for i, p in enumerate(self.pieces):
            self.piece_to_id.setdefault(p, i)
        side = read_sidecar(path, self.vocab_size)
        self.byte_level = side.get("type") == "byte_level"
        self.bos_id = side.get("bos_id", BOS_ID)
        self.eos_id = side.get("eos_id", EOS_ID)
        self.add_bos = bool(side.get("add_bos", True))
        self.special = set(side.get("special_ids", [])) if self.byte_level else set()
        self.pretokenizer = side.get("pretokenizer", "none")
        # specials longest first, so that a longer one wins where two start at the same place
        self.special_pieces = sorted(((self.pieces[i], i) for i in self.special if self.pieces[i]),
                                     key=lambda x: (-len(x[0]), x[1]))
        self.byte_ids = {}
        if self.byte_level:
            for i, p in enumerate(self.pieces):
                if len(p) == 1 and i not in self.special:
                    self.byte_ids.setdefault(p[0], i)

    def _initial_ids(self, text):
        """One id per codepoint, or one byte-fallback id per UTF-8 byte."""
        ids = []
        for ch in text:
            b = ch.encode("utf-8")
            tid = self.piece_to_id.get(b)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(x + BYTE_FALLBACK_OFFSET for x in b)
        return ids

    def _merge(self, ids):
        """Apply llama2.c's merge loop to ids and return the merged list.

        llama2.c rescans all pairs after every merge (quadratic). A heap keyed by
        (-score, position of the left symbol) picks the same pair at every step,
        because positions keep their order: highest score first, leftmost on ties.
        """
        n = len(ids)
        tok = list(ids)
        nxt = list(range(1, n + 1))  # nxt[i] == n marks the end
        prv = list(range(-1, n - 1))
        alive = [True] * n
        version = [0] * n  # bumped when a symbol changes, to spot stale heap entries
        heap = []

        def push(i):
            if i < 0 or nxt[i] >= n:
                return
            j = nxt[i]
            tid = self.piece_to_id.get(self.pieces[tok[i]] + self.pieces[tok[j]])
            if tid is not None and tid not in self.special:
                heapq.heappush(heap, (-self.scores[tid], i, version[i], j, version[j], tid))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, vi, j, vj, tid = heapq.heappop(heap)
            # skip entries made stale by an earlier merge touching either symbol
            if not (alive[i] and alive[j] and nxt[i] == j and version[i] == vi
                    and version[j] == vj):
                continue
            tok[i] = tid
            version[i] += 1
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            push(prv[i])
            push(i)
        return [tok[i] for i in range(n) if alive[i]]

    def _encode_byte_level(self, text):
        """Specials matched literally; each stretch between them: bytes, then merges."""
        data = text.encode("utf-8")
        ids, start, pos = [], 0, 0

        def flush(end):
            a = start
            while a < end:  # pre-tokens; bytes without a token of their own are dropped
                b = (end if self.pretokenizer == "none" else
                     pretoken_end(data, a, end, self.pretokenizer == "gpt2_digits"))
                ids.extend(self._merge([self.byte_ids[x] for x in data[a:b] if x in self.byte_ids]))
                a = b

        while pos < len(data):
            hit = next(((p, i) for p, i in self.special_pieces if data.startswith(p, pos)), None)
            if hit is None:
                pos += 1
                continue
            flush(pos)
            ids.append(hit[1])
            pos += len(hit[0])
            start = pos
        flush(len(data))
        return ids

    def encode(self, text, bos=True, eos=False):
        """Encode str to ids the way llama2.c's encode() (or the byte-level rules) does."""
        ids = [self.bos_id] if bos and (self.add_bos or not text) else []
        if self.byte_level:
            ids.extend(self._encode_byte_level(text))
            return ids + ([self.eos_id] if eos else [])
        # llama2.c adds the dummy prefix only for non-empty text (sentencepiece add_dummy_prefix)
        if text:
            ids.extend(self._merge(self._initial_ids(" " + text)))
        if eos:
            ids.append(self.eos_id)
        return ids

    def piece_bytes(self, tid, prev=None):
        """Bytes for one token, with llama2.c's decode rules (byte-level: the piece itself)."""
        piece = self.pieces[tid]
        if self.byte_level:
            return piece
        if prev == self.bos_id and piece.startswith(b" "):
            piece = piece[1:]
        value = _byte_piece_value(piece)
        return bytes([value]) if value is not None else piece

    def decode(self, ids):
        """Decode ids to str (invalid UTF-8 replaced)."""
        out, prev = [], None
        for tid in ids:
            out.append(self.piece_bytes(tid, prev))
            prev = tid
        return b"".join(out).decode("utf-8", errors="replace")

"""The llama2.c tokenizer.bin format and its encoder/decoder.

File: int32 max_token_length, then per token: float32 score, int32 len, len bytes.
The vocabulary size is not stored; tokens run to end of file.
Encoding follows llama2.c's run.c: dummy-prefix space, one token per UTF-8
codepoint (byte fallback ids = byte + 3), then greedy merges of the adjacent pair
with the highest vocab score. The C trainer uses the same file, so the two must
agree token for token.
"""
import heapq
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


class Tokenizer:
    def __init__(self, path):
        self.path = path
        self.pieces, self.scores, self.max_token_length = read_tokenizer_bin(path)
        self.vocab_size = len(self.pieces)
        # first id wins on duplicate pieces, like a sorted-vocab lookup would mostly do
        self.piece_to_id = {}
        for i, p in enumerate(self.pieces):
            self.piece_to_id.setdefault(p, i)

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
            if tid is not None:
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

    def encode(self, text, bos=True, eos=False):
        """Encode str to ids the way llama2.c's encode() does."""
        ids = [BOS_ID] if bos else []
        # llama2.c adds the dummy prefix only for non-empty text (sentencepiece add_dummy_prefix)
        if text:
            ids.extend(self._merge(self._initial_ids(" " + text)))
        if eos:
            ids.append(EOS_ID)
        return ids

    def piece_bytes(self, tid, prev=None):
        """Bytes for one token, with llama2.c's decode rules."""
        piece = self.pieces[tid]
        if prev == BOS_ID and piece.startswith(b" "):
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

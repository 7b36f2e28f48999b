"""Random training data for the GPU benchmarks (scripts/bench/bench_gpu.sh), with the standard library
alone (the GPU machine may have no numpy): a token shard (LMFT, scripts/formats/shards.py's layout) and an
image shard (IMGS, scripts/data/prepare_images.py's layout). Speed and memory do not depend on values.

usage: python3 scripts/bench/bench_data.py tokens PATH VOCAB COUNT
       python3 scripts/bench/bench_data.py images PATH N SIZE CLASSES"""
import os
import random
import struct
import sys


def write_atomic(path, chunks):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


def tokens(path, vocab, count):
    rng = random.Random(0)
    head = struct.pack("<4sIQII", b"LMFT", 1, count, vocab, 1).ljust(64, b"\0")
    ids = struct.pack(f"<{count}I", *(rng.randrange(vocab) for _ in range(count)))
    write_atomic(path, [head, ids, b"\1" * count])


def images(path, n, size, classes):
    head = (b"IMGS" + struct.pack("<6I", 1, n, size, size, 3, classes)).ljust(64, b"\0")
    labels = struct.pack(f"<{n}H", *(i % classes for i in range(n)))
    write_atomic(path, [head, os.urandom(n * size * size * 3), labels])


if __name__ == "__main__":
    kind, path, *nums = sys.argv[1:]
    {"tokens": tokens, "images": images}[kind](path, *map(int, nums))

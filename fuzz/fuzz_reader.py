"""A standing coverage-guided fuzzer of kvtool's reader and verifier (atheris, libFuzzer's engine).

Every input is a whole file, read from memory: the reader opens it, `verify`'s checks run on it,
every chunk and extra is decoded. The contract (container.md §5): an input either verifies clean,
or raises a `KvtoolError`, never another exception, never a hang (libFuzzer's -timeout), never an
allocation past -rss_limit_mb. Seeds: the files of format-spec/vectors (every codec, both extras).

    python fuzz/fuzz_reader.py -runs=1000000 -rss_limit_mb=2048 -timeout=10 WORKDIR/corpus format-spec/vectors
    python fuzz/fuzz_reader.py -max_total_time=60 ...      (CI: tests/test_fuzz_standing.py)

The corpus directory (first argument) collects the inputs that found new coverage.

-rss_limit_mb is checked against the process's peak RSS (getrusage ru_maxrss), which Linux carries
over execve: started by a large process (Python's subprocess vfork + exec), the fuzzer begins at its
parent's peak. Start it from a shell or through a small launcher (tests/test_fuzz_standing.py).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["kvtool"]):
    from kvtool.errors import KvtoolError
    from kvtool.format import ContainerReader
    from kvtool.format.hashing import crc32
    from kvtool.format.layout import TRAILER_SIZE, TRAILER_STRUCT
    from kvtool.format.reader import BytesSource
    from kvtool.ops.verify import check_file


def with_manifest_crc_fixed(data: bytes) -> bytes | None:
    """The input with its trailer's manifest CRC made right, so that mutations of the manifest's
    JSON reach the manifest parser and validator instead of stopping at the checksum."""
    if len(data) < TRAILER_SIZE:
        return None
    offset, length, _, reserved, magic = TRAILER_STRUCT.unpack(data[-TRAILER_SIZE:])
    if offset + length > len(data) - TRAILER_SIZE:
        return None
    fixed = TRAILER_STRUCT.pack(offset, length, crc32(data[offset:offset + length]), reserved, magic)
    return data[:-TRAILER_SIZE] + fixed


def one_input(data: bytes) -> None:
    read(data)
    fixed = with_manifest_crc_fixed(data)
    if fixed is not None and fixed != data:
        read(fixed)


def read(data: bytes) -> None:
    try:
        with ContainerReader(BytesSource(data, "fuzz.kvc")) as reader:
            check_file(reader)  # structure, CRCs, decoding, finiteness, hashes, padding, extras
            for chunk in reader.chunks:
                reader.read_chunk_array(chunk.index, verify=False)  # decoders on unchecked bytes too
    except KvtoolError:
        pass  # a refusal, in one line: what the contract asks


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

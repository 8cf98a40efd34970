"""The streamed oracle (oracle/streamed.py): layer-by-layer scoring from safetensors equals the in-memory oracle
bitwise, reads each layer once per pass, rejects bad checkpoints before computing, and names bad token ids."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
from oracle.checkpoint import CheckpointError, hf_part_of, normalised_names
from oracle.streamed import StreamedOracle, fits_in_memory, in_memory_bytes, score_tokens, token_scores
from oracle.zoo import VARIANTS
from hybridqual.qualify.compare import teacher_forced_logits, top2_margin

TINY_SORT = os.path.join(os.path.dirname(__file__), "..", "goldens", "models", "tiny-sort")


def _requests(vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Prompts that cross chunk boundaries (zoo chunk 8), one with no tokens to score, one single-token prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [(ids(5), ids(7)), (ids(1), []), (ids(13), ids(9))]


def _assert_streamed_equals_in_memory(folder: str, seed: int) -> None:
    model, so = oracle.load(folder, dtype=torch.float64), StreamedOracle(folder)
    reqs = _requests(model.config.vocab_size, seed)
    rows = so.score(reqs)
    for (prompt, tokens), got in zip(reqs, rows):
        want = model.prefill(prompt + tokens)[0][len(prompt) - 1:]
        assert got.dtype == torch.float64 and got.shape == (len(tokens) + 1, model.config.vocab_size)
        assert torch.equal(got, want), (folder, len(prompt), len(tokens))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streamed_equals_in_memory_bitwise_on_every_zoo_variant(zoo_folder, variant):
    """StreamedOracle.score rows == oracle.load(fp64).prefill(prompt + tokens) rows, torch.equal, batch of 3."""
    _assert_streamed_equals_in_memory(zoo_folder(variant, seed=1), seed=len(variant))


def test_streamed_equals_in_memory_bitwise_on_tiny_sort():
    """The shipped trained model too."""
    _assert_streamed_equals_in_memory(TINY_SORT, seed=0)


def test_streamed_equals_in_memory_on_a_sharded_bf16_anchor_variant(tmp_path):
    """tools/anchor.py's small variant (Bamba layout, chunk 256, bf16 shards): streamed == in-memory bitwise."""
    from hybridqual.anchor import anchor_config, write_anchor
    cfg = anchor_config(scale=16, layers=8)
    assert cfg.chunk_size == 256 and cfg.attention_layer_ids == (7,) and cfg.mamba_d_state == 128
    info = write_anchor(os.fspath(tmp_path / "a"), cfg, seed=3, layers_per_shard=3)
    assert info["shards"] == 4 and os.path.exists(tmp_path / "a" / "model.safetensors.index.json")
    assert oracle.load(tmp_path / "a").config == cfg
    _assert_streamed_equals_in_memory(os.fspath(tmp_path / "a"), seed=5)


def test_anchor_tool_refuses_to_overwrite_and_rejects_a_scale_that_does_not_divide(tmp_path, capsys):
    """`hybridqual.anchor write` into an existing folder needs --force; --scale must divide every width; `score` runs."""
    from hybridqual.anchor import anchor_config, main
    out = os.fspath(tmp_path / "a")
    assert main(["write", out, "--scale", "16", "--layers", "2"]) == 0
    assert main(["write", out, "--scale", "16", "--layers", "2"]) == 2
    assert "exists (use --force" in capsys.readouterr().err
    assert main(["write", out, "--scale", "16", "--layers", "2", "--seed", "1", "--force"]) == 0
    assert not os.path.exists(out + ".partial")
    with pytest.raises(ValueError, match="--scale: 3 must be a positive integer dividing"):
        anchor_config(scale=3)
    assert main(["score", out, "--prompt", "3", "--tokens", "2"]) == 0
    assert "logits finite True" in capsys.readouterr().out
    assert main(["score", out, "--device", "bogus"]) == 2
    assert "error: device: 'bogus'" in capsys.readouterr().err


def test_streamed_reads_each_layer_once_and_only_that_layer(zoo_folder, monkeypatch):
    """One pass per batch: top tensors, then layer 0, 1, ... each read once, each read holding one part only."""
    folder = zoo_folder("nemotron_h")
    so = StreamedOracle(folder)
    reads = []
    real = so.index.read
    monkeypatch.setattr(so.index, "read", lambda names: reads.append(list(names)) or real(names))
    so.score(_requests(so.config.vocab_size, 0))
    parts = []
    for names in reads:
        kinds = {hf_part_of(so.config, n) for n in normalised_names(so.config, names)}
        assert len(kinds) == 1, kinds
        parts.append(kinds.pop())
    assert parts == ["top", *range(so.config.num_layers), "top"]


def _copy(zoo_folder, variant: str, tmp_path) -> str:
    dst = os.fspath(tmp_path / variant)
    shutil.copytree(zoo_folder(variant), dst)
    return dst


def test_streamed_rejects_a_misshapen_or_missing_tensor_before_computing(zoo_folder, tmp_path):
    """Header-only check at construction: a wrong shape or a missing tensor in the last layer is a CheckpointError
    naming it (no layer is run first)."""
    folder = _copy(zoo_folder, "bamba", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    t = load_file(path)
    t["model.layers.2.mamba.out_proj.weight"] = torch.zeros(32, 63)
    save_file(t, path)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mamba\.out_proj\.weight.*shape \(32, 63\)"):
        StreamedOracle(folder)
    t.pop("model.layers.2.mamba.out_proj.weight")
    save_file(t, path)
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model\.layers\.2\.mamba\.out_proj\.weight"):
        StreamedOracle(folder)


def test_streamed_names_a_nan_weight_when_its_layer_is_read(zoo_folder, tmp_path):
    """NaN weights are found when the layer's data is read (headers cannot show them): CheckpointError naming it."""
    folder = _copy(zoo_folder, "granitemoehybrid", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    t = load_file(path)
    t["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(t, path)
    so = StreamedOracle(folder)
    with pytest.raises(CheckpointError, match=r"non-finite \(NaN/Inf\) weights in: layers\.1\.attn\.k_proj\.weight"):
        so.score([([1, 2, 3], [4])])


@pytest.mark.parametrize("reqs,pattern", [
    ([([1, 2], [3, 96])], r"requests\[0\]\.tokens\[1\]: token id 96 is out of range for vocab_size=96"),
    ([([1, 2], [3]), ([1.5], [3])], r"requests\[1\]\.prompt\[0\]: token id must be an integer, got 1\.5"),
    ([([True], [3])], r"requests\[0\]\.prompt\[0\]: token id must be an integer, got True"),
    ([([], [3])], r"requests\[0\]\.prompt: empty prompt"),
    ([("abc", [3])], r"requests\[0\]\.prompt: expected a list of token ids"),
    ([([1, 2], [3]), [1, 2, 3]], r"requests\[1\]: expected a \(prompt, tokens\) pair"),
])
def test_streamed_rejects_bad_token_ids_naming_the_request(zoo_folder, reqs, pattern):
    """Token ids are checked (no truncation of floats, no bools, in range) with the request and position named."""
    so = StreamedOracle(zoo_folder("mamba2"))
    with pytest.raises(ValueError, match=pattern):
        so.score(reqs)


@pytest.mark.parametrize("kw,pattern", [({"device": "bogus"}, r"device: 'bogus' is not a torch device"),
                                        ({"device": "meta"}, r"device: 'meta' is not supported"),
                                        ({"dtype": torch.bfloat16}, r"dtype: the streamed oracle computes in float64")])
def test_streamed_rejects_a_bad_device_or_dtype(zoo_folder, kw, pattern):
    """Bad device names and non-fp64/fp32 dtypes are ValueErrors naming the argument, not torch tracebacks."""
    with pytest.raises(ValueError, match=pattern):
        StreamedOracle(zoo_folder("mamba2"), **kw)


def _prefill_then_decode(model, prompt, tokens):
    """The rows as generation computes them: a prefill, then one decode (the recurrence) per token."""
    logits, state = model.prefill(list(prompt))
    rows = [logits[-1]]
    for tok in tokens[:-1]:
        step, state = model.decode(int(tok), state)
        rows.append(step)
    return torch.stack(rows)


def test_teacher_forced_logits_one_pass_match_prefill_decode(zoo_folder):
    """The one-pass rows, streamed and in memory (hybridqual.qualify.compare.teacher_forced_logits), equal generation's
    prefill + decode rows to 1e-12: the same truth computed by the chunked scan instead of token by token."""
    folder = zoo_folder("bamba-g4-clamp")
    model, so = oracle.load(folder), StreamedOracle(folder)
    prompt, tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
    want = _prefill_then_decode(model, prompt, tokens)
    for got in (so.teacher_forced_logits(prompt, tokens), teacher_forced_logits(model, prompt, tokens)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_tie_aware_compare_accepts_the_streamed_oracle(zoo_folder):
    """hybridqual.qualify.compare.compare_tie_aware with a StreamedOracle in place of the model: the same verdicts (greedy
    output passes; a flipped token fails at its position) as with the in-memory oracle."""
    from hybridqual.qualify.compare import compare_tie_aware
    folder = zoo_folder("granitemoehybrid")
    model, so = oracle.load(folder), StreamedOracle(folder)
    prompt = [4, 8, 15, 16, 23, 42]
    good = model.generate_greedy(prompt, 8)
    bad = good[:3] + [(good[3] + 1) % 96] + good[4:]
    for toks in (good, bad):
        a, b = (compare_tie_aware(m, "r", prompt, toks, [], 8, tau=1e-9) for m in (model, so))
        assert (a.ok, a.compared, a.failure and a.failure.position) == (b.ok, b.compared, b.failure and
                                                                      b.failure.position)
    assert b.failure is not None and b.failure.position == 3


def test_prefetch_serves_teacher_forced_logits_bitwise_in_one_pass(zoo_folder, monkeypatch):
    """prefetch(requests) reads the weights once; teacher_forced_logits then returns the same bits as a fresh
    pass, for any split of the sequence into prompt + tokens, without reading again."""
    so = StreamedOracle(zoo_folder("bamba"))
    reqs = _requests(96, 7)
    fresh = [so.teacher_forced_logits(p, t) for p, t in reqs]
    fresh_split = so.teacher_forced_logits(reqs[2][0] + reqs[2][1][:4], reqs[2][1][4:])
    so.prefetch(reqs)
    monkeypatch.setattr(so.index, "read", lambda names: pytest.fail("read after prefetch"))
    for (p, t), want in zip(reqs, fresh):
        assert torch.equal(so.teacher_forced_logits(p, t), want)
    assert torch.equal(so.teacher_forced_logits(reqs[2][0] + reqs[2][1][:4], reqs[2][1][4:]), fresh_split)
    so.clear()
    with pytest.raises(pytest.fail.Exception, match="read after prefetch"):
        so.teacher_forced_logits(*reqs[0])


def test_prefetch_of_kept_sequences_reads_no_weights(zoo_folder, monkeypatch):
    """A second prefetch of the same requests (qualify's next mode with the same tokens) makes no streamed pass;
    one new request among them is read for alone."""
    so = StreamedOracle(zoo_folder("bamba"))
    reqs = _requests(96, 7)
    so.prefetch(reqs[:-1])
    monkeypatch.setattr(so.index, "read", lambda names: pytest.fail("read for kept sequences"))
    so.prefetch(reqs[:-1])
    passes = []
    monkeypatch.undo()
    real = so.sequence_logits
    monkeypatch.setattr(so, "sequence_logits", lambda seqs: passes.append(list(seqs)) or real(seqs))
    so.prefetch(reqs)
    assert passes == [[tuple(reqs[-1][0] + reqs[-1][1])]]


def test_token_scores_give_argmax_margins_and_gaps(zoo_folder):
    """score_tokens: top-1 = argmax, margin = hybridqual.qualify.compare.top2_margin, gap 0 exactly where the token is top-1."""
    folder = zoo_folder("nemotron_h")
    model = oracle.load(folder)
    prompt = [7, 3, 11]
    greedy = model.generate_greedy(prompt, 6)
    other = [(t + 1) % 96 for t in greedy]
    [s_greedy, s_other] = score_tokens(folder, [(prompt, greedy), (prompt, other)])
    for s, toks in ((s_greedy, greedy), (s_other, other)):
        assert s.top1 == [int(torch.argmax(r)) for r in s.logits]
        assert s.margins == [top2_margin(r) for r in s.logits]
        assert all(s.top1[k] != s.top2[k] for k in range(len(s.top1)))
        assert [g == 0.0 for g in s.gaps] == [s.top1[k] == t for k, t in enumerate(toks)]
    assert s_greedy.top1[:6] == greedy and all(g > 0 for g in s_other.gaps[:1])
    with pytest.raises(ValueError, match="vocab of >= 2"):
        token_scores(torch.zeros(2, 1, dtype=torch.float64), [0])


def test_fits_in_memory_counts_fp64_weights(zoo_folder, monkeypatch):
    """in_memory_bytes is 8 bytes per parameter (tied lm_head once); a tiny model fits; oracle.load refuses a
    model that needs more than MemAvailable before allocating, pointing at the streamed oracle."""
    import oracle.streamed as streamed
    folder = zoo_folder("mamba2")
    cfg = oracle.from_hf_config(folder)
    n = sum(t.numel() for k, t in oracle.load_checkpoint(folder)[1].items() if k != "lm_head.weight")
    assert in_memory_bytes(cfg) == 8 * n and fits_in_memory(folder)
    assert streamed.load_bytes(folder) == 8 * n + 4 * n              # + the stored fp32 copy while casting
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 12 * n - 1)
    assert not fits_in_memory(folder)
    monkeypatch.setattr(oracle.checkpoint, "read_safetensors", lambda p: pytest.fail("allocated"))
    with pytest.raises(CheckpointError,
                       match=r"needs 0\.0 GiB of host RAM, 0\.0 GiB available; score with oracle\.streamed"):
        oracle.load(folder)
    StreamedOracle(folder).score([([1], [2])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streamed_on_cuda_agrees_with_cpu_fp64(zoo_folder):
    """fp64 on the GPU (cuBLAS) is not bitwise CPU (MKL), but agrees to 1e-10 on every architecture."""
    for variant in ("bamba", "nemotron_h", "mamba2", "granitemoehybrid"):
        folder = zoo_folder(variant)
        reqs = _requests(96, 1)
        cpu, gpu = StreamedOracle(folder).score(reqs), StreamedOracle(folder, device="cuda").score(reqs)
        for a, b in zip(cpu, gpu):
            assert b.device.type == "cuda" and b.dtype == torch.float64
            torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_memory_oracle_on_cuda_agrees_with_cpu_fp64(zoo_folder):
    """oracle.load(..., device="cuda"): weights, states and logits on the GPU, within 1e-10 of CPU fp64."""
    for variant in ("bamba", "nemotron_h", "mamba2", "granitemoehybrid"):
        folder = zoo_folder(variant)
        cpu, gpu = oracle.load(folder), oracle.load(folder, device="cuda")
        a, sa = cpu.prefill([1, 2, 3, 4, 5])
        b, sb = gpu.prefill([1, 2, 3, 4, 5])
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-10)
        torch.testing.assert_close(gpu.decode(6, sb)[0].cpu(), cpu.decode(6, sa)[0], rtol=0, atol=1e-10)

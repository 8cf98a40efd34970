"""Scenarios fit any model: every scenario instantiates (or skips with a reason) on every shipped model and on a
chunk-256 model; instances equal the shipped traces (so goldens match by trace sha256); ids fit the vocab; the
boundary and admission-order scenarios really hit what they claim, and a scheduler that gets them wrong differs."""
from __future__ import annotations

import hashlib
import json

import pytest

import oracle
from oracle import scheduler as oracle_scheduler
from oracle.trace import check_against_model, dump_trace, load_trace, parse_trace
from hybridqual.goldens import regen as goldens
from hybridqual.scenarios import plan as scenarios
from hybridqual.scenarios.edges import ScheduleModel, census_of
from hybridqual.scenarios.units import ScenarioError, Units

SHIPPED = sorted(p for p in scenarios.MODELS.iterdir() if (p / "config.json").exists())
BOUNDARIES = {"piece_budget": {"last_eq_budget", "last_less_budget", "cut_more_budget", "skip_then_fit"},
              "piece_chunk": {"last_eq_chunk", "last_less_chunk", "cut_more_chunk", "multi_piece_nonmultiple"}}


def _config(model_dir):
    return oracle.from_hf_config(model_dir / "config.json")


def _ids(trace):
    return [t for r in trace.requests for t in (*r.prompt, *r.stop_token_ids)]


def _assert_valid(inst, vocab, chunk):
    assert (inst.trace is None) != (inst.skip_reason is None), inst
    if inst.trace is None:
        assert inst.skip_reason.strip() and inst.concrete is None
        return
    assert inst.family in scenarios.FAMILIES
    assert inst.concrete == inst.trace.to_json() and parse_trace(inst.concrete, vocab) == inst.trace
    assert all(0 <= t < vocab for t in _ids(inst.trace)), inst.scenario
    check_against_model(inst.trace, vocab, chunk)


# tiny-sort declares max_position_embeddings 256: no room for long_context's 1100-token prompt (its skip says so)
POSITION_SKIPS = {("tiny-sort", "long_context")}


@pytest.mark.parametrize("model_dir", SHIPPED, ids=lambda p: p.name)
def test_every_scenario_instantiates_on_every_shipped_model(model_dir):
    cfg = _config(model_dir)
    insts = scenarios.instantiate(model_dir, cfg)
    assert [i.scenario for i in insts] == list(scenarios.SCENARIOS)
    for inst in insts:
        _assert_valid(inst, cfg.vocab_size, cfg.chunk_size)
        if (model_dir.name, inst.scenario) in POSITION_SKIPS:
            assert inst.trace is None and "max_position_embeddings" in inst.skip_reason
            continue
        assert inst.trace is not None, f"{inst.scenario} skipped on {model_dir.name}: {inst.skip_reason}"


D_CONV_UNITS = {"prefix_lru"}     # shipped scenarios whose prompts depend on d_conv (suffixes of d_conv tokens)
SHIPPED_D_CONV = 4                # the d_conv the shipped traces are written for


@pytest.mark.parametrize("model_dir", SHIPPED, ids=lambda p: p.name)
def test_shipped_models_instantiate_to_the_shipped_traces_and_their_goldens(model_dir):
    cfg = _config(model_dir)
    for inst in scenarios.instantiate(model_dir, cfg):
        path = scenarios.shipped_trace_path(inst.scenario)
        golden = goldens.OUTPUTS / model_dir.name / f"{inst.scenario}.json"
        if inst.scenario in D_CONV_UNITS and cfg.mamba_d_conv != SHIPPED_D_CONV:
            continue        # written in d_conv units: zoo-corners (d_conv 3) gets its own trace, truth at qualify time
        if path is not None and goldens.trace_fits(load_trace(path), cfg.vocab_size):
            assert dump_trace(inst.trace) == dump_trace(load_trace(path)), inst.scenario
            assert golden.exists(), f"no golden for {model_dir.name} x {inst.scenario}"
        if golden.exists():
            sha = hashlib.sha256(dump_trace(inst.trace).encode()).hexdigest()
            assert json.loads(golden.read_text())["trace_sha256"] == sha, golden


def test_every_scenario_but_the_short_task_variants_has_a_shipped_trace_and_the_families_are_the_issue_s():
    # the short task variants exist for the main job's time budget only; a shipped file would put them in every
    # corpus-parametrised test (minutes on the Triton interpreter), so their truth is the oracle run at qualify time
    # piece_tails, cobatch_reuse, decode_buckets and long_context likewise: folded ids on the tiny model (no one concrete trace),
    # truth at qualify time, their engine tests in tests/test_scenarios_boundaries.py
    unshipped = {n for n in scenarios.SCENARIOS if scenarios.shipped_trace_path(n) is None}
    assert unshipped == {"task_burst_short", "task_staggered_short", "piece_tails", "cobatch_reuse", "decode_buckets",
                         "long_context"}
    assert set(scenarios.FAMILIES) >= {"seed_compaction", "async_drain", "chunked_prefill", "seeded_sampling",
                                       "slot_exhaustion", "stop_tokens", "task_burst", "task_staggered",
                                       "request_order", "prefill_boundaries", "special_ids"}


@pytest.fixture(scope="module")
def chunk256(tmp_path_factory):
    """An HF folder of zoo Bamba with chunk_size 256 (the HF default and real Bamba / Granite-4.0-H)."""
    from oracle.zoo import write_hf_folder
    path = tmp_path_factory.mktemp("zoo-bamba-c256")
    write_hf_folder(path, "bamba", seed=0, chunk_size=256)
    return path


def test_chunk_256_model_instantiates_every_scenario(chunk256):
    cfg = _config(chunk256)
    assert cfg.chunk_size == 256
    for inst in scenarios.instantiate(chunk256, cfg):
        _assert_valid(inst, cfg.vocab_size, 256)
        assert inst.trace is not None, f"{inst.scenario} skipped at chunk 256: {inst.skip_reason}"
        assert inst.trace.engine.prefill_chunk >= 256
    long = scenarios.instantiate(chunk256, cfg, ["chunked_prefill"])[0].trace.request("long")
    assert len(long.prompt) == 5 * 256 + 5                  # still longer than budget and prefill_chunk


def test_chunk_256_instance_runs_through_the_oracle(chunk256):
    model = oracle.load(chunk256)
    inst = scenarios.instantiate(chunk256, model.config, ["piece_chunk"])[0]
    legacy = oracle.run_trace(model, inst.trace, mode="legacy")
    assert set(legacy.tokens) == {r.id for r in inst.trace.requests}
    assert all(len(legacy.tokens[r.id]) == r.max_new_tokens for r in inst.trace.requests)
    assert census_of(inst.trace, 256, model.config.vocab_size) == BOUNDARIES["piece_chunk"]


@pytest.mark.parametrize("chunk", [4, 8, 16, 256])
@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_boundary_scenarios_hit_every_piece_boundary(name, chunk):
    inst = scenarios.instantiate_one(name, Units(chunk, 96, 1, 2, 0, (0, 1, 2)))
    assert census_of(inst.trace, chunk, 96) == BOUNDARIES[name]


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_piece_splitter_off_by_one_changes_the_boundary_schedules(name, monkeypatch):
    """A splitter that takes the rest only when it is strictly below the limit gives a different log."""
    inst = scenarios.instantiate_one(name, Units(8, 96))
    model = ScheduleModel(96, 8)
    want = oracle_scheduler.run_trace(model, inst.trace, "legacy").digest

    def strict(start, prompt_len, left, prefill_chunk, chunk_size):
        cap = min(left, prefill_chunk)
        return prompt_len - start if prompt_len - start < cap else (cap // chunk_size) * chunk_size
    monkeypatch.setattr(oracle_scheduler, "piece_length", strict)
    assert oracle_scheduler.run_trace(model, inst.trace, "legacy").digest != want


def test_request_order_lists_same_step_arrivals_out_of_admission_order():
    tr = scenarios.instantiate_one("request_order", Units(8, 96)).trace
    listed = [(r.arrival_step, r.id) for r in tr.requests]
    assert listed != sorted(listed)
    same_step = [r.id for r in tr.requests if r.arrival_step == 0]
    assert len(same_step) >= 3 and sorted(same_step) != sorted(same_step, key=lambda i: int(i[1:]))
    log = oracle_scheduler.run_trace(ScheduleModel(96, 8), tr, "legacy").schedule_log.to_json()
    admitted = [a["request"] for s in log["steps"] for a in s["admit"]]
    assert admitted == [i for _, i in sorted(listed)]


@pytest.mark.parametrize("order", ["file", "numeric", "id_only"])
def test_request_order_schedule_changes_under_a_wrong_admission_order(order, monkeypatch):
    tr = scenarios.instantiate_one("request_order", Units(8, 96)).trace
    model = ScheduleModel(96, 8)
    want = oracle_scheduler.run_trace(model, tr, "legacy").digest
    key = {"file": lambda r: (r.arrival_step,), "id_only": lambda r: (r.id,),
           "numeric": lambda r: (r.arrival_step, int("".join(c for c in r.id if c.isdigit())))}[order]
    real_init = oracle_scheduler.Scheduler.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.arrival_order = sorted(self.trace.requests, key=key)
    monkeypatch.setattr(oracle_scheduler.Scheduler, "__init__", init)
    assert oracle_scheduler.run_trace(model, tr, "legacy").digest != want


def test_folded_ids_avoid_the_special_ids_and_special_ids_uses_them():
    cfg = _config(scenarios.MODELS / "tiny-sort")
    units = Units.from_config(cfg)
    assert (units.bos, units.eos, units.pad) == (1, 2, 0)
    folded = scenarios.instantiate_one("slot_exhaustion", units).trace
    assert folded.description == load_trace(scenarios.shipped_trace_path("slot_exhaustion")).description
    assert _ids(folded) and not set(_ids(folded)) & {0, 1, 2}
    sp = scenarios.instantiate_one("special_ids", units).trace
    assert {0, 1} <= {t for r in sp.requests for t in r.prompt} and all(r.stop_token_ids == (2,) for r in sp.requests)


def test_scenarios_skip_with_their_reason_where_they_cannot_fit():
    tiny_vocab = {i.scenario: i for i in
                  (scenarios.instantiate_one(n, Units(8, 6, 1, 2, 0, (0, 1, 2))) for n in scenarios.SCENARIOS)}
    assert "ordinary token ids" in tiny_vocab["chunked_prefill"].skip_reason
    small_chunk = scenarios.instantiate_one("piece_budget", Units(2, 96))
    assert small_chunk.trace is None and "chunk_size 2" in small_chunk.skip_reason
    no_ids = scenarios.instantiate_one("special_ids", Units(8, 96))
    assert no_ids.trace is None and "eos_token_id" in no_ids.skip_reason


def test_unknown_scenario_name_is_a_clear_error():
    with pytest.raises(ScenarioError, match="'nope' is not one of"):
        scenarios.instantiate(SHIPPED[0], _config(SHIPPED[0]), ["nope"])


def test_default_plan_covers_every_family_on_shipped_models():
    plan = scenarios.default_plan()
    cover = scenarios.plan_coverage(plan)
    assert all(cover[f] for f in scenarios.FAMILIES), {f: c for f, c in cover.items() if not c}
    for model_dir, names in plan:
        assert model_dir in SHIPPED
        for inst in scenarios.instantiate(model_dir, _config(model_dir), names):
            assert inst.trace is not None, (model_dir.name, inst.scenario, inst.skip_reason)


def test_default_run_qualifies_prefix_caching_and_speculation_through_shipped_traces():
    """The main job's default run also covers the four features that scenarios do not build, with
    shipped concrete traces whose file says the family it is listed under, on a model they fit."""
    from hybridqual.qualify.runner import instance_from_file
    cover = scenarios.plan_coverage()
    assert set(scenarios.TRACE_FAMILIES) == {"prefix_cache", "speculative", "preemption", "transfer"}
    assert all(cover[f] for f in scenarios.TRACE_FAMILIES), cover
    listed = {f"{m}:{n}": f for m, f, names in scenarios.DEFAULT_TRACES for n in names}
    plan = scenarios.main_job_plan()          # every scenario entry and every trace file, each once
    assert [(m, n) for m, n, f in plan if f is None] == scenarios.default_plan()
    assert [(m, f) for m, n, f in plan if f is not None] == scenarios.default_trace_plan()
    for model_dir, files in scenarios.default_trace_plan():
        assert model_dir in SHIPPED
        for path in files:
            inst = instance_from_file(path, _config(model_dir))
            assert inst.trace is not None, (path.name, inst.skip_reason)
            assert listed[f"{model_dir.name}:{path.stem}"] == inst.family, (path.name, inst.family)

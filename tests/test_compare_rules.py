"""The tie-aware comparison rules of DESIGN §5 (tools/qualify/compare.py) on a model whose ties are placed by design."""
import torch

from hybridqual.qualify.compare import compare_bitwise, compare_tie_aware

V, NEAR = 8, 1e-4


class DesignedModel:
    """Top-1 = sum(context) % V; the runner-up (top-1 + 1) trails by NEAR when len(context) % 5 == 0, else by 2."""

    @staticmethod
    def row(ctx):
        top = sum(ctx) % V
        r = torch.zeros(V, dtype=torch.float64)
        r[top] = 3.0
        r[(top + 1) % V] = 3.0 - (NEAR if len(ctx) % 5 == 0 else 2.0)
        return r

    def prefill(self, tokens, state=None):
        ctx = list(state or []) + list(tokens)
        return torch.stack([self.row(ctx[:i + 1]) for i in range(len(state or []), len(ctx))]), ctx

    def decode(self, token, state):
        ctx = state + [token]
        return self.row(ctx), ctx


def greedy(model, prompt, n):
    ctx, out = list(prompt), []
    for _ in range(n):
        t = int(torch.argmax(model.row(ctx)))
        out.append(t)
        ctx.append(t)
    return out


M, PROMPT, N = DesignedModel(), [1, 2, 3, 4], 10          # len(ctx) % 5 == 0 first at generated position 1


def test_identical_tokens_pass_with_every_position_compared():
    v = compare_tie_aware(M, "r", PROMPT, greedy(M, PROMPT, N), [], N, tau=1e-3)
    assert v.ok and v.compared == N and not v.near_ties


def test_near_tie_is_reported_then_checked_teacher_forced():
    truth = greedy(M, PROMPT, N)
    swapped = (truth[1] + 1) % V                         # the runner-up at the near tie
    cand = truth[:1] + [swapped] + greedy(M, PROMPT + truth[:1] + [swapped], N - 2)

    def continue_from(prefix):                           # the candidate continues greedily after the oracle's prefix
        return greedy(M, PROMPT + prefix, N - len(prefix))

    v = compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-3, continue_from=continue_from)
    assert v.ok and [m.position for m in v.near_ties] == [1] and v.compared == N
    assert v.near_ties[0].oracle_gap <= 1e-3 and v.near_ties[0].candidate_token == swapped
    # without a continuation the check stops at the tie and says so
    v = compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-3)
    assert v.ok and "stopped at near tie" in v.note


def test_a_difference_above_tau_fails_with_position_tokens_and_gap():
    truth = greedy(M, PROMPT, N)
    cand = truth[:3] + [(truth[3] + 1) % V] + truth[4:]   # position 3: margin 2.0, not a tie
    v = compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-3)
    assert not v.ok and v.failure.position == 3 and v.failure.oracle_token == truth[3]
    assert abs(v.failure.oracle_gap - 2.0) < 1e-12
    # the same swap at the near tie fails too when tau is below the tie's gap
    cand = truth[:1] + [(truth[1] + 1) % V] + truth[2:]
    assert not compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-6).ok


def test_finish_rule_is_checked():
    truth = greedy(M, PROMPT, N)
    assert not compare_tie_aware(M, "r", PROMPT, truth[:5], [], N, tau=1e-3).ok       # stopped early, no stop token
    stop = truth[4]
    early = truth.index(stop)
    assert compare_tie_aware(M, "r", PROMPT, truth[:early + 1], [stop], N, tau=1e-3).ok


def test_bitwise_comparison_names_the_first_difference():
    assert compare_bitwise({"a": [1, 2, 3]}, {"a": [1, 2, 3]}) == []
    [msg] = compare_bitwise({"a": [1, 2, 3]}, {"a": [1, 5, 3]})
    assert "position 1" in msg and "(2 vs 5)" in msg


def test_seeded_requests_are_judged_in_the_samplers_decision_space():
    from oracle.sampling import seeded
    from oracle.trace import Sampling
    s = Sampling("seeded", 4.0, 1234)            # hot enough to leave the top-1 where the margin is 2
    ctx, truth = list(PROMPT), []
    for _ in range(N):
        t = seeded(M.row(ctx), s.temperature, s.seed, len(ctx))
        truth.append(t)
        ctx.append(t)
    assert truth != greedy(M, PROMPT, N), "the draws must differ from greedy, or this test proves nothing"
    assert compare_tie_aware(M, "r", PROMPT, truth, [], N, tau=1e-3, sampling=s).ok
    assert not compare_tie_aware(M, "r", PROMPT, truth, [], N, tau=1e-3).ok       # judged as greedy: fails


def test_every_emitted_token_is_judged_on_its_own_prefix_even_after_a_near_tie():
    truth = greedy(M, PROMPT, N)
    swapped = (truth[1] + 1) % V
    own = greedy(M, PROMPT + truth[:1] + [swapped], N - 2)
    cand = truth[:1] + [swapped] + own[:2] + [(own[2] + 1) % V] + own[3:]   # a non-tie error after the tie

    def continue_from(prefix):                           # the continuation from the oracle's prefix is fine
        return greedy(M, PROMPT + prefix, N - len(prefix))

    v = compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-3, continue_from=continue_from)
    assert not v.ok and v.failure.position == 4 and [m.position for m in v.near_ties] == [1]


def test_forgiven_ties_carry_count_eligible_positions_and_smallest_margin():
    truth = greedy(M, PROMPT, N)
    swapped = (truth[1] + 1) % V
    cand = truth[:1] + [swapped] + greedy(M, PROMPT + truth[:1] + [swapped], N - 2)
    v = compare_tie_aware(M, "r", PROMPT, cand, [], N, tau=1e-3)
    # the designed near ties sit where len(context) % 5 == 0: generated positions 1 and 6 of the own walk
    assert v.eligible == 2 and len(v.near_ties) == 1 and abs(v.min_tie_margin - NEAR) < 1e-12


def test_tie_bound_allows_rounding_flips_but_not_a_runner_up_bias():
    from hybridqual.qualify.compare import MEASURED_ERR, TAU, tie_bound
    fp32, bf16 = torch.float32, torch.bfloat16
    assert tie_bound(0, fp32, TAU[fp32]) == 1                       # one flip is always plausible
    assert tie_bound(100, fp32, TAU[fp32]) < 10                     # p = 2E/τ ≈ 0.023
    assert tie_bound(100, bf16, TAU[bf16]) < 100                    # an engine flipping every close call fails
    assert tie_bound(100, bf16, 2 * MEASURED_ERR[bf16]) >= 100      # τ at 2E: every eligible flip is plausible


def test_logits_check_fails_a_monotone_rescale_that_keeps_every_argmax():
    from hybridqual.qualify.compare import LOGITS_C, compare_logits
    g = torch.Generator().manual_seed(0)
    want = torch.randn(12, 96, generator=g, dtype=torch.float64) * 3
    noise = (torch.rand(12, 96, generator=g, dtype=torch.float64) - 0.5) * 2e-5   # fp32-sized rounding
    c = LOGITS_C[torch.float32]
    assert compare_logits("r", (want + noise).float(), want, c).ok
    scaled = want * 1.01
    assert torch.equal(scaled.argmax(-1), want.argmax(-1))
    v = compare_logits("r", scaled.float(), want, c)
    assert not v.ok and v.worst_error > v.worst_bound
    assert not compare_logits("r", want[:5].float(), want, c).ok                  # a missing row fails too


def test_mismatch_and_logits_verdict_report_the_rank_of_the_candidates_token_in_the_oracle_row():
    """The rank (logits strictly above the candidate's token) is what the top-k part of the near-tie rule bounds;
    both verdicts carry it so a run at size records the distribution a rank rule would be measured from."""
    from hybridqual.qualify.compare import Verdict, _judge, compare_logits
    row = torch.tensor([5.0, 4.9, 4.8, 4.7, 4.6, 4.5, 4.4, 0.0], dtype=torch.float64)
    mm = _judge("r", row, tok=6, pos=0, tau=1.0, verdict=Verdict("r", True, 0))
    assert (mm.oracle_rank, mm.near_tie) == (6, False)        # gap 0.6 <= τ but rank 6 is outside the top 5
    mm = _judge("r", row, tok=3, pos=0, tau=1.0, verdict=Verdict("r", True, 0))
    assert (mm.oracle_rank, mm.near_tie) == (3, True)
    want = torch.stack([row, row])
    got = want.clone()
    got[1, 2] += 0.5                                        # the candidate's argmax at position 1 is the oracle's rank 2
    v = compare_logits("r", got, want, c=1.0)
    assert v.ok and v.max_rank == 2


def test_rank_bound_follows_the_dtype_a_bf16_flip_deep_in_a_flat_row_is_a_tie_a_deeper_one_is_not():
    """top_k_for(bf16) is measured (a legitimate bf16 flip at oracle rank 9 on anchor-3b's flat logits); fp32 keeps
    k = 5. Below the bound and within τ: a near tie; past the bound: a failure even within τ."""
    import torch as t

    from hybridqual.qualify.compare import TAU, Verdict, _judge, top_k_for
    row = t.linspace(5.0, 4.0, 40, dtype=t.float64)             # 40 tokens within 1.0 < τ(bf16) of the top
    k16, k32 = top_k_for(t.bfloat16), top_k_for(t.float32)
    assert k32 == 5 and k16 > 9
    judge = lambda tok, k: _judge("r", row, tok, 0, TAU[t.bfloat16], Verdict("r", True, 0), k)  # noqa: E731
    assert judge(9, k16).near_tie and not judge(9, k32).near_tie
    assert not judge(k16 + 3, k16).near_tie and judge(k16 + 3, k16).oracle_gap <= TAU[t.bfloat16]

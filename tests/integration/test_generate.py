"""KV-cached pipelined generation (pp_compress.generate) on 2 CPU processes: the recipe's tiny GPT."""
import json
from pathlib import Path

from tests.integration.launch import HANG_S, run_job

WORKER = Path(__file__).with_name("generate_worker.py")


def run(out: Path, *args: str) -> dict[int, dict]:
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(WORKER, 2, "--out", str(out), *args, timeout=HANG_S)
    assert rc == 0, log[-4000:]
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}


def test_identity_gives_the_recompute_paths_greedy_tokens_with_prompts_of_different_lengths(tmp_path):
    res = run(tmp_path, "--spec", "none", "--new", "12")
    r0 = res[0]
    assert r0["tokens"] == r0["reference"] and res[1]["tokens"] == r0["tokens"]  # every rank gets the tokens
    assert len({tuple(t) for t in r0["tokens"]}) == 4 and all(len(set(t)) > 1 for t in r0["tokens"][:3])  # not trivial
    # prompts of 5, 9, 3, 9 tokens are left-padded to 9: prefill sends (4, 9, 64) fp32 once, each decode step (4, 1, 64)
    assert r0["stats"]["traffic"]["prefill"] == [4 * 9 * 64 * 4] * 2 + [4 * 9 * 64]
    assert r0["stats"]["traffic"]["decode"] == [11 * 4 * 64 * 4] * 2 + [11 * 4 * 64]
    # with a stop token each sequence ends at its first occurrence (kept), the others run to max_new_tokens
    stop = r0["stop"]
    for full, cut in zip(r0["tokens"], r0["stopped"]):
        assert cut == (full[: full.index(stop) + 1] if stop in full else full)
    assert r0["stopped"][0] == r0["tokens"][0][:3] and res[1]["stopped"] == r0["stopped"]
    # teacher-forced scoring of prompt + generated tokens in one pass: each generated token is its position's top-1
    for p_len, top1, tokens, lp in zip([5, 9, 3, 9], r0["scored_top1"], r0["tokens"], r0["scored_logprob"]):
        assert top1[p_len - 1:] == tokens and len(lp) == p_len + 11 and all(v <= 0 for v in lp)


def test_int8_decode_steps_send_one_position_per_sequence_compressed(tmp_path):
    res = run(tmp_path, "--spec", "int8,min_numel=0", "--new", "12")
    t = res[0]["stats"]["traffic"]
    assert t["decode"][1] == 11 * (4 * 64 + 4 * 2)  # per step: 4 sequences x 64 int8 codes + 4 bf16 scales
    assert t["prefill"][1] == 4 * 9 * 64 + 4 * 9 * 2
    same = sum(a == b for x, y in zip(res[0]["tokens"], res[0]["reference"]) for a, b in zip(x, y))
    assert same >= 0.8 * 4 * 12  # int8 boundaries change a greedy token rarely


def test_a_prompt_longer_than_the_context_is_a_clear_error(tmp_path):
    res = run(tmp_path, "--prompt-len", "60", "--new", "8", "--context", "64")
    assert all("longer than the model's context of 64 positions" in r["error"] for r in res.values())

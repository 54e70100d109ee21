"""The companion demo's engine step budget: vLLM's defaults unless --max-num-batched-tokens N, then the same
N-token budget (long-prefill cap N/2) for every configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.demo import companion
from kvtier.demo.calibrate import fit_profile
from kvtier.demo.common import ModelFacts
from kvtier.demo.sizing import WorkloadFacts
from kvtier.demo.steps import StepBudget, choose_step_budget
from kvtier.server import build_command

FACTS = ModelFacts(path=Path("/nonexistent/model"), kv_bytes_per_token=46_080, max_model_len=8192, dtype="float32")
WF = WorkloadFacts(requests=104, prompt_tokens=162_213, ideal_hit_tokens=129_536, think_s=500.0, max_prompt_tokens=3900)
# a slow AVX2 VM's calibration: 256 / 512 / 1024 tokens in 1.3 / 2.9 / 6.9 s
SLOW = fit_profile([(256, 1.3), (512, 2.9), (1024, 6.9)])


def test_default_and_zero_mean_vllm_defaults_n_is_n_tokens_in_blocks() -> None:
    assert choose_step_budget(SLOW) == choose_step_budget(SLOW, 0) == StepBudget(None, None, "vLLM default")
    assert choose_step_budget(SLOW, 0).engine_args() == (None, ())
    b = choose_step_budget(SLOW, 1000)
    assert (b.tokens, b.prefill_cap, b.source) == (896, 384, "--max-num-batched-tokens")
    assert b.step_s == SLOW.seconds(896)
    assert choose_step_budget(SLOW, 50).tokens == 128 and choose_step_budget(SLOW, 50).prefill_cap == 128


def test_every_configuration_runs_with_the_same_budget() -> None:
    b = companion.budgets(companion.DEFAULT, FACTS, WF)
    step = choose_step_budget(SLOW, 256)
    specs = companion.server_specs(companion.DEFAULT, FACTS, b, "live", step)
    assert {(s.max_num_batched_tokens, s.extra_args) for s in specs} == \
        {(step.tokens, ("--long-prefill-token-threshold", str(step.prefill_cap)))}
    cmd = build_command(specs[0], port=8000)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == str(step.tokens)
    assert cmd[cmd.index("--long-prefill-token-threshold") + 1] == str(step.prefill_cap)
    plain = companion.server_specs(companion.DEFAULT, FACTS, b, "live", choose_step_budget(SLOW))
    assert all(s.max_num_batched_tokens is None and s.extra_args == () for s in plain)


def test_cli_rejects_a_negative_step_budget() -> None:
    import typer

    from kvtier.commands import demo_cmd

    app = typer.Typer()
    demo_cmd.register(app)
    res = CliRunner().invoke(app, ["demo", "--max-num-batched-tokens", "-5"])
    assert res.exit_code == 2 and "--max-num-batched-tokens" in res.output

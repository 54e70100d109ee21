"""The example that shows a GPU user how to put kvtier's tiers under vLLM's native offloading:
``examples/vllm-tiering/kv-transfer-config.json`` is a valid ``--kv-transfer-config`` for vLLM, its
secondary tier loads by module path with ``vllm-tier.yaml``, and vLLM's TieringOffloadingSpec builds
a working manager from it (paths moved to temp directories)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtier.integrations.vllm_tiering import KvtierSecondaryTier
from kvtier.integrations.vllm_tiering.settings import TierSettings
from tests.unit import vllm_tiering_rig as rig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm-tiering"


def _kv_transfer() -> dict:
    return json.loads((EXAMPLE / "kv-transfer-config.json").read_text())


def test_the_example_is_a_valid_kv_transfer_config_naming_the_tier():
    raw = _kv_transfer()
    cfg = KVTransferConfig(**raw)
    assert cfg.kv_connector == "OffloadingConnector"
    extra = cfg.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec"
    [entry] = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is KvtierSecondaryTier
    assert Path(entry["kvtier_config_file"]).name == "vllm-tier.yaml"
    names = (EXAMPLE.parent / "README.md").read_text()
    assert "vllm-tiering/" in names


def test_the_example_yaml_loads_as_the_tiers_settings():
    [entry] = _kv_transfer()["kv_connector_extra_config"]["secondary_tiers"]
    s = TierSettings.from_entry(str(EXAMPLE / "vllm-tier.yaml"), None, entry["enable_kv_events"], entry["locality"],
                                entry["job_threads"], env={})
    assert s.kvtier.store.disk.enabled and s.kvtier.store.shared.kind == "sharedfs"
    store = s.store_config(chunk_tokens=256)
    assert not store.memory.enabled and store.chunk_size == 256


def test_vllms_tiering_spec_builds_a_working_manager_from_the_example(tmp_path):
    raw = _kv_transfer()
    extra = raw["kv_connector_extra_config"]
    [entry] = extra["secondary_tiers"]
    entry = {**entry, "kvtier_config_file": str(EXAMPLE / "vllm-tier.yaml"),
             "kvtier_config": {"store": {"disk": {"path": str(tmp_path / "nvme")},
                                         "shared": {"path": str(tmp_path / "jfs"), "create": True}}}}
    cfg = rig.offloading_config(num_chunks=4, secondary_tiers=[entry], events=True)
    manager = rig.spec(cfg).get_manager()
    view = manager.primary_tier.get_kv_memoryview()
    prim = np.frombuffer(view, dtype=np.int8).reshape(view.shape)
    try:
        [tier] = manager.secondary_tiers
        assert [t.name for t in tier.store.tiers] == ["disk", "sharedfs"]
        k = rig.keys(1, seed=1)
        req = ReqContext(req_id="a")
        manager.on_new_request(req)
        out = manager.prepare_store(k, req)
        prim[out.store_spec.chunk_ids[0]] = 5
        manager.complete_store(k, req)
        step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        # scheduler steps until the store job is done (its write is a background thread's: a count of
        # steps would be a hidden speed bound, missed on a busy machine)
        end = time.monotonic() + 30
        while True:
            manager.on_schedule_end(step)
            if not manager.has_pending_work() or time.monotonic() > end:
                break
            time.sleep(0.002)
        assert not manager.has_pending_work()
        assert tier.lookup(k[0], req) is LookupResult.HIT
        assert tier.store.flush(30)
        assert list((tmp_path / "jfs").rglob("*.kvc"))         # written through to the shared tier
        manager.on_request_finished(req)
    finally:
        del prim
        view = None
        manager.shutdown()

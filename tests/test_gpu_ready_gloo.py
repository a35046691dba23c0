"""What a GPU would punish and gloo on the CPU forgives, checked on 2 gloo ranks:

* a steady step of a compiled, fused model, with kept ``.grad``s and inside ``join()``
  too, reads no tensor value on the host (on a GPU each read is a device sync: the host
  loses its run-ahead in the middle of backward), makes no tensor from host data on a device
  (``torch.tensor(..., device=)``: on a GPU a copy from pageable memory that blocks the
  host the same way; join()'s prelude did, found by the GPU suite), and issues on the
  model's process group exactly its buckets' all-reduces: the per-step plan check runs
  on the host group (host_group.py), not as an all-gather of one value per rank on the
  model's group (O(N) hops in a ring);
* every tensor ddp_fusion hands to a collective is on the model's device: with
  ``torch.set_default_device("meta")`` a factory that forgot ``device=`` makes a meta
  tensor where, on a GPU, it would make a CPU tensor that NCCL refuses.
"""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_gpu_ready import collectives_on_the_group_device, steady_steps

STEPS = 3


def test_a_steady_step_reads_nothing_on_the_host_and_issues_only_its_buckets(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # c10d's flight recorder, in the ranks
    for r in run_ranks(steady_steps, world_size=2, args=(STEPS,), timeout=600, pg_timeout=60):
        assert r["reads"] == {}, r
        # the plan check's group and host group as its first step found them (looked up
        # again every step, they cost ~50 us of a GPT-2's 4 ms CPU step: issue 36)
        assert r["lookups"] == r["kept_lookups"] == r["join_lookups"] == {}, r
        # Net's two buckets at bucket_cap_mb=0.002: (b.bias, b.weight), (a.bias, a.weight)
        assert r["collectives"] == [("gloo:all_reduce", r["group"])] * (STEPS * 2), r
        # kept .grads, each bucket reduced in place in them (on the GPU suite's list
        # after join(), not yet run on a GPU)
        assert r["kept_reads"] == {}, r
        assert r["kept_collectives"] == [("gloo:all_reduce", r["group"])] * (STEPS * 2), r
        # inside join(), per step also torch's Join's notice that this rank still trains
        # and the prelude's all-reduce of the ranks still training (torch DDP issues
        # both too); that count stays on the device as the divisor (before: a host read
        # in every forward)
        assert r["join_reads"] == {}, r
        assert r["join_collectives"] == [("gloo:all_reduce", r["group"])] * (STEPS * 4), r


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_collective_gets_tensors_on_the_models_device():
    for seen in run_ranks(collectives_on_the_group_device, world_size=2, timeout=300, pg_timeout=30):
        assert seen and {device for _, device in seen} == {"cpu"}, seen

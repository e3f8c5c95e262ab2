"""``rundir.resume_mismatch`` with the number of processes: refused for a checkpoint that does not
reshard; for one that does, allowed when the global batch stays the same."""

from leantrain.train import rundir


def _cfg(batch: int, replicate: int = 1) -> dict:
    return {"data": {"batch_size": batch}, "dist": {"mode": "fsdp", "replicate": replicate}}


def test_another_world_size_is_refused_without_resharding():
    diffs = rundir.resume_mismatch(_cfg(2), _cfg(2), world=2, saved_world=4)
    assert diffs == ["4 processes (this run: 2; run torchrun --nproc-per-node 4)"]


def test_a_resharding_checkpoint_resumes_at_another_world_size_with_the_same_global_batch():
    assert rundir.resume_mismatch(_cfg(2, replicate=2), _cfg(4), world=2, saved_world=4, reshard=True) == []


def test_a_changed_global_batch_names_the_batch_size_that_keeps_it():
    [diff] = rundir.resume_mismatch(_cfg(2), _cfg(2), world=2, saved_world=4, reshard=True)
    assert "global batch of 8" in diff and "pass --data.batch-size 4" in diff
    [diff] = rundir.resume_mismatch(_cfg(2), _cfg(1), world=3, saved_world=4, reshard=True)
    assert "divides 8" in diff


def test_the_same_world_size_keeps_batch_size_a_config_field():
    [diff] = rundir.resume_mismatch(_cfg(2), _cfg(4), world=2, saved_world=2, reshard=True)
    assert diff.startswith("data.batch_size 2")

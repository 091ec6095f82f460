"""train.deterministic in the real Trainer (CPU, ZeRO-3, spawned process): the switch is on
during the run and off again after close, and on a CPU, which is bit-reproducible anyway, it
changes no loss. (Bit-equality of two deterministic GPU runs is the GPU report's to show.)"""

from __future__ import annotations

import pytest

from distributed import run_distributed_test
from test_train_nan import OVERRIDES


def _runs(run_dir: str) -> dict:
    import torch

    from tape_train.config import load_run_config
    from tape_train.train.loop import Trainer

    out = {}
    for on in (False, True):
        trainer = Trainer(load_run_config(None, OVERRIDES + [
            f"train.run_dir={run_dir}/{on}",
            f"train.deterministic={str(on).lower()}"]))
        trainer.setup()
        out[f"during_{on}"] = torch.are_deterministic_algorithms_enabled()
        out[f"losses_{on}"] = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.close()
        out[f"after_{on}"] = torch.are_deterministic_algorithms_enabled()
    return out


@pytest.mark.distributed
def test_deterministic_switch_is_scoped_to_the_run_and_keeps_cpu_losses(tmp_path):
    [result] = run_distributed_test(_runs, world_size=1, args=(str(tmp_path),), timeout=300)
    assert result["during_True"] and not result["during_False"]
    assert not result["after_True"] and not result["after_False"]
    assert result["losses_True"] == result["losses_False"]
    assert result["losses_True"][0] != result["losses_True"][2]  # it trained

"""What a transformer call that no engine covers is told: the dimension that is out of range, and
the build that would cover it (a batch, or T5's length), not a hint about the other one."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sd_accel.profiles import Profile
from sd_accel.runtime.coverage import uncovered

# FLUX.1's transformer at 512 px, batch 1, T5 length 256: its inputs as the engine takes them
SHAPES = {"hidden_states": ((1, 1024, 64),) * 3, "encoder_hidden_states": ((1, 256, 4096),) * 3,
          "timestep": ((1,),) * 3, "img_ids": ((1024, 3),) * 3, "txt_ids": ((256, 3),) * 3}


def _handle():
    tag = Profile(batch=(1, 1, 1), height=(512,) * 3, width=(512,) * 3, text=(256,) * 3).tag
    return SimpleNamespace(record=SimpleNamespace(key=SimpleNamespace(profile=tag)), shapes=SHAPES)


def _feed(batch: int, text: int) -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.zeros(batch, 1024, 64), "encoder_hidden_states": torch.zeros(batch, text, 4096),
            "timestep": torch.zeros(batch), "img_ids": torch.zeros(1024, 3), "txt_ids": torch.zeros(text, 3)}


def test_a_batch_the_engine_lacks_asks_for_a_batch_not_a_t5_length():
    reason = uncovered(_feed(2, 256), [_handle()])
    assert "the engines cover 512x512 px, batch 1, T5 length 256" in reason, reason
    assert "hidden_states dim 0 is 2, the engine takes 1" in reason, reason
    assert "build one whose batch reaches 2" in reason and "T5 length reaches" not in reason, reason


def test_a_t5_length_the_engine_lacks_asks_for_that_length():
    reason = uncovered(_feed(1, 512), [_handle()])
    assert "encoder_hidden_states dim 1 is 512, the engine takes 256" in reason, reason
    assert "T5 length reaches the pipeline's max_sequence_length" in reason and "batch reaches" not in reason, reason

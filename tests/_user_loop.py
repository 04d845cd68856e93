"""A training loop that calls the model itself, as the README allows for ``pp = 1``: the
forward ``parallel(inputs)``, the user's own loss inside ``parallel.loss_context()``,
gradient clipping and the optimizer.

``python tests/_user_loop.py MODEL PLAN STEPS CLIP [LOSS]`` prints the losses as JSON
(rank 0); under torchrun it joins the gloo process group first. MODEL is a
``module:function`` path or a Hugging Face config directory; CLIP is ``stock``
(``torch.nn.utils.clip_grad_norm_``: right for data parallel and FSDP, an error naming
``parallel.clip_grad_norm_`` where it would be wrong) or ``parallel``; LOSS is ``own``
(the default: cross-entropy of the logits) or ``labels`` (a Hugging Face model's own
loss, ``parallel(inputs, labels=targets).loss``, with only the backward in
``loss_context()``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import planner

LR, MAX_NORM = 0.1, 0.5


def main(source: str, plan_path: str, steps: int, clip: str, loss_from: str = "own") -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    if Path(source).is_dir():
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(source)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # as the README
    else:
        model = planner.resolve_model(source, device="cpu", seed=0).module
    parallel = planner.parallelize(model, plan_path)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=LR)
    batch, seq = parallel.plan.training.global_batch_size, parallel.plan.seq_len
    losses = []
    for step in range(steps):
        tokens = torch.randint(
            0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(step)
        )
        inputs, targets = parallel.local_batch(tokens[:, :-1], tokens[:, 1:])
        if loss_from == "labels":
            loss = parallel(inputs, labels=targets).loss
            with parallel.loss_context():
                loss.backward()
        else:
            out = parallel(inputs)
            logits = out.logits if hasattr(out, "logits") else out
            with parallel.loss_context():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
        if clip == "stock":
            torch.nn.utils.clip_grad_norm_(parallel.parameters(), MAX_NORM)
        else:
            parallel.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        if dist.is_initialized():  # each rank's loss is over its own share: average them
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"steps": [{"loss": value} for value in losses]}))
    if dist.is_initialized():
        dist.barrier()  # as the README says: no rank tears down while a peer still works
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])

"""A training loop written the way the README tells users to: ``planner.parallelize`` a
model they built, then train it as usual (the loss inside ``loss_context(plan)``).

``python tests/_user_loop.py MODEL PLAN STEPS`` prints the losses as JSON (rank 0);
under torchrun it joins the gloo process group first. MODEL is a ``module:function``
path or a Hugging Face config directory.
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
from strategies.apply import loss_context

VOCAB, BATCH, SEQ, LR = 256, 8, 16, 0.1


def main(source: str, plan_path: str, steps: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    if Path(source).is_dir():
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    else:
        model = planner.resolve_model(source, device="cpu", seed=0).module
    plan = planner.load_document(planner.Plan, plan_path)
    parallel = planner.parallelize(model, plan)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        tokens = torch.randint(
            0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step)
        )
        out = parallel(tokens[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        with loss_context(plan):
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"steps": [{"loss": value} for value in losses]}))
    if dist.is_initialized():
        dist.barrier()  # as the README says: no rank tears down while a peer still works
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

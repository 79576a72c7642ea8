"""Run by tests/test_distributed.py under ``torchrun --nproc-per-node 2``: sweeps on a tiny
model with every rank taking its share, each rank pickling what it got back.

usage: sharded_sweep.py OUT_DIR MODE    (MODE: sweeps | fail | too_many)
"""

import os
import pickle
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import cpsuper as cp  # noqa: E402
from cpsuper import engine, sweeps  # noqa: E402

out, mode = Path(sys.argv[1]), sys.argv[2]
rank, size = cp.distributed.init_distributed()
model = cp.tiny_model("gemma", seed=0)
data = cp.conflict_dataset("world_capital", n=3, tokenizer=model)
result: dict = {"rank": rank, "size": size}
try:
    if mode == "sweeps":
        calls, run = [], engine.run_conditions

        def counted(model, token_lists, answer_ids, conditions, **options):
            calls.append(len(conditions))
            return run(model, token_lists, answer_ids, conditions, **options)

        # sweep_dataset calls the engine, which calls itself again on this rank's share
        engine.run_conditions = sweeps.run_conditions = counted
        result["head_sweep_calls"] = calls
        result["heads"] = cp.head_sweep(model, data, alphas=(0.0, 2.0), progress=False).per_example
        engine.run_conditions = sweeps.run_conditions = run
        result["knockouts"] = cp.knockout_sweep(model, data, progress=False).per_example
        result["identified"] = cp.identify_heads(model, data, k=2, progress=False).scores
    elif mode == "fail":
        if rank == 1:  # this rank breaks in the middle of its share

            def broken(*args, **kwargs):
                raise RuntimeError("injected failure on this rank")

            engine.unembed_final = broken
        cp.head_sweep(model, data, alphas=(0.0,), progress=False)
    elif mode == "too_many":
        cp.cumulative_knockout(model, data, [], progress=False)  # one condition (k = 0) for two ranks
except Exception as error:  # the test reads what each rank saw
    result["error"] = f"{type(error).__name__}: {error}"
with open(out / f"rank{rank}.pkl", "wb") as f:
    pickle.dump(result, f)

"""Resumable training state in files small enough to carry between machines.

A state is a folder (OUT/train_state/): index.json (the step, the schedule's progress, the time
spent, every tensor's shape, dtype and where its pieces lie) and shard-NNNNN.safetensors files of
at most `shard_mib` MiB each (a tensor larger than a shard is cut into flat pieces). It holds the
drafter's float32 weights, the optimizer's state (AdamW moments in `moments_dtype`: float32 for an
exact resume, bfloat16 for a third less; the weights stay float32 either way) and the training
batches' random generator. A new state is written beside the old one and swapped in by renames,
so a run killed while saving leaves the previous state readable. Loading needs the same drafter
shape and optimizer.

Size: 4 + 2 * 4 bytes per drafter parameter in float32 (4 + 2 * 2 in bfloat16); the 2-layer
drafter of the 1.5B (about 105M parameters) is about 1.26 GB (0.84 GB), ~81 (~54) shards of 15 MiB.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8, "int64": torch.int64,
           "float16": torch.float16}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flat_tensors(drafter: torch.nn.Module, optim: torch.optim.Optimizer, gen: torch.Generator,
                 moments_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list]:
    """(name -> tensor, the optimizer's param_groups) of a training state; moments cast to moments_dtype."""
    out = {f"model.{k}": v.detach().float().cpu() for k, v in drafter.state_dict().items()}
    sd = optim.state_dict()
    for idx, st in sd["state"].items():
        for key, v in st.items():
            t = torch.as_tensor(v).detach().cpu()
            if key in ("exp_avg", "exp_avg_sq") and t.is_floating_point():
                t = t.to(moments_dtype)
            out[f"optim.{idx}.{key}"] = t
    out["rng.batches"] = gen.get_state()
    return out, sd["param_groups"]


def save_state(path: Path, drafter: torch.nn.Module, optim: torch.optim.Optimizer, gen: torch.Generator,
               meta: dict, moments_dtype: torch.dtype = torch.float32, shard_mib: float = 15.0) -> int:
    """Write the state folder `path` (see the module docstring); returns its size in bytes."""
    tensors, groups = flat_tensors(drafter, optim, gen, moments_dtype)
    limit = max(1024, int(shard_mib * 2**20))
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    index: dict[str, dict] = {}
    for name, t in tensors.items():
        flat = t.contiguous().reshape(-1)
        per = max(1, limit // max(1, flat.element_size()))
        pieces = []
        for j, start in enumerate(range(0, max(1, flat.numel()), per)):
            piece = flat[start : start + per].clone()
            nbytes = piece.numel() * piece.element_size()
            if sizes[-1] and sizes[-1] + nbytes > limit:
                shards.append({})
                sizes.append(0)
            key = f"{name}#{j}"
            shards[-1][key] = piece
            sizes[-1] += nbytes
            pieces.append([len(shards) - 1, key])
        index[name] = {"shape": list(t.shape), "dtype": _name(t.dtype), "pieces": pieces}
    files = [f"shard-{i:05d}.safetensors" for i in range(len(shards))]
    for f, sd in zip(files, shards, strict=True):
        save_file(sd, str(tmp / f))
    for entry in index.values():
        entry["pieces"] = [[files[i], k] for i, k in entry["pieces"]]
    doc = {"meta": meta, "param_groups": groups, "moments_dtype": _name(moments_dtype), "files": files,
           "tensors": index}
    (tmp / INDEX).write_text(json.dumps(doc) + "\n")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return sum((path / f).stat().st_size for f in files) + (path / INDEX).stat().st_size


def read_meta(path: Path) -> dict | None:
    """The `meta` a state was saved with (None when there is no state at `path`)."""
    f = path / INDEX
    return json.loads(f.read_text())["meta"] if f.is_file() else None


def load_state(path: Path, drafter: torch.nn.Module, optim: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    """Restore weights, optimizer state and the batch generator from `path`; returns the saved meta."""
    doc = json.loads((path / INDEX).read_text())
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, e in doc["tensors"].items():
        parts = []
        for f, key in e["pieces"]:
            if f not in loaded:
                loaded[f] = load_file(str(path / f))
            parts.append(loaded[f][key])
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        tensors[name] = flat.reshape(e["shape"]).to(_DTYPES[e["dtype"]])
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    own = drafter.state_dict()
    drafter.load_state_dict({k: model[k].to(own[k].dtype) for k in own})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, idx, key = k.split(".", 2)
            state.setdefault(int(idx), {})[key] = v  # load_state_dict moves and casts them as the params need
    optim.load_state_dict({"state": state, "param_groups": doc["param_groups"]})
    gen.set_state(tensors["rng.batches"])
    return doc["meta"]

"""The parts of bt's update timed apart, for benchmarks/gpu.py (--parts and --workspace).

--parts: one fresh process with a step process's numerics environment times, each synchronized,
median of 20 after 3 warm-ups: forward+backward with determinism off and on (alternated, 3 rounds
of 7 each), gradient clipping, buildtrain's AdamW and torch's (fused on CUDA), the invariant
reduction's gradient vector (to a vector and back), and the per-update record (`record.Recorder`:
the weights' fingerprints on the device, the lines written every RECORD_EVERY updates, amortized).
Then the record at GPT-2 small's parameter count (124M: 50,257 x 768 embedding, 12 blocks of
width 768, MLP 3,072), whatever the shape: blake3 of every weight on the host (the record before
issue 44 on the CPU, and still the record at a checkpoint) against the fingerprints, with their
ratio.

--workspace: forward+backward as bt computes it (deterministic algorithms), in fresh processes
alternated, with CUBLAS_WORKSPACE_CONFIG=:4096:8 and without it (torch's own workspace): the
variable is read when CUDA starts, so only a fresh process can compare it. Where the installed
torch still requires it, the process without it warns instead of failing
(use_deterministic_algorithms' warn_only), so that its speed is still measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from common import Workspace, alternate, median, note, print_table, ratio

WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
GPT2_SMALL = {"vocab": 50257, "dim": 768, "layers": 12, "hidden": 3072}


def parts_child(spec: dict[str, Any], build_model: Callable[[dict[str, Any]], Any]) -> dict[str, float]:
    """Milliseconds of each part of buildtrain's update, timed apart (see --parts)."""
    import torch

    sys.path.insert(0, spec["src"])
    from buildtrain.executor.process import numerics
    from buildtrain.steps.train.optimizer import AdamW
    from buildtrain.steps.train.reduce import gradients_to_vector, vector_to_gradients
    from buildtrain.steps.train.trainer import param_groups

    device = torch.device(spec["device"])
    numerics.apply_after_import(torch, "native", device.type, 1)  # what a CUDA step process sets
    model = build_model({**spec, "model": "buildtrain"}).to(device)
    parameters = list(model.parameters())
    forward_backward = forward_backward_of(model, spec, device)
    ours = AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    theirs = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **fused)
    loss = torch.zeros((), device=device)
    both: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):  # alternated, so that neither mode gets the warmer caches
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            both[deterministic] += samples(forward_backward, device, count=7)
    times = {
        "forward+backward, determinism off": median(both[False]),
        "forward+backward, deterministic (bt)": median(both[True]),
    }
    times["clip_grad_norm_"] = timed(lambda: torch.nn.utils.clip_grad_norm_(parameters, 1.0), device)
    times["AdamW, buildtrain (bt)"] = timed(ours.update, device)
    times["AdamW, torch " + next(iter(fused))] = timed(theirs.step, device)
    times["gradient vector and back (bt)"] = timed(
        lambda: vector_to_gradients(gradients_to_vector(parameters, loss), parameters), device
    )
    weights = {f"model.{name}": p.detach() for name, p in model.named_parameters()}
    times["per-update record (bt)"] = record_ms(weights, device)
    times.update(gpt2_records(device))
    return times


def forward_backward_of(
    model: Any, spec: dict[str, Any], device: Any, loss: Callable[..., Any] | None = None
) -> Callable[[], None]:
    """One forward and backward of bt's loss (or `loss`) on a fixed batch (bf16 autocast on CUDA)."""
    import torch

    from buildtrain.steps.train.gradient import token_loss

    loss_of = loss or token_loss

    shape, vocab = spec["shape"], spec["vocab"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows = torch.randint(
        0, vocab, (shape["batch"], shape["seq"] + 1), generator=torch.Generator().manual_seed(1)
    )
    rows = rows.to(device)
    parameters = list(model.parameters())

    def forward_backward() -> None:
        for parameter in parameters:
            parameter.grad = None
        with autocast:
            loss = loss_of(model(rows[:, :-1]), rows[:, 1:], None)
        loss.backward()

    return forward_backward


def record_ms(weights: dict[str, Any], device: Any, updates: int = 0) -> float:
    """Milliseconds per update of the record between checkpoints: `updates` updates' weights
    fingerprinted (default RECORD_EVERY), then their lines written (the one copy to the host),
    divided by `updates`; the median of 5 after a warm-up."""
    from buildtrain.steps.train.record import RECORD_EVERY, Recorder, update_entry

    recorder, updates = Recorder(set()), updates or RECORD_EVERY

    def batch() -> None:
        for update in range(1, updates + 1):
            recorder.update(update_entry(update, 1.0, 1.0, 3e-4, 0), "weights", lambda: weights)
        recorder.flush(lambda line: None)

    return median(samples(batch, device, warmup=1, count=5)) / updates


def gpt2_records(device: Any) -> dict[str, float]:
    """The record of 124M parameters (GPT-2 small's tensors): blake3 on the host, then the
    fingerprints (lines written every 8 updates: on a CPU, 64 would cost minutes and show
    nothing more), each the median of 5 after a warm-up."""
    import torch

    from buildtrain.steps.train.state import digests

    vocab, dim, hidden = GPT2_SMALL["vocab"], GPT2_SMALL["dim"], GPT2_SMALL["hidden"]
    shapes = {"wte": (vocab, dim), "norm": (dim,)}
    for block in range(GPT2_SMALL["layers"]):
        for name, shape in (("qkv", (3 * dim, dim)), ("proj", (dim, dim)), ("up", (hidden, dim))):
            shapes[f"{block}.{name}"] = shape
        shapes.update({f"{block}.down": (dim, hidden), f"{block}.n1": (dim,), f"{block}.n2": (dim,)})
    generator = torch.Generator().manual_seed(2)
    weights = {f"model.{k}": torch.randn(s, generator=generator).to(device) for k, s in shapes.items()}
    return {
        "record of 124M parameters: blake3 on the host (before)": median(
            samples(lambda: digests(weights), device, warmup=1, count=5)
        ),
        "record of 124M parameters: fingerprints (bt)": record_ms(weights, device, updates=8),
    }


def workspace_child(spec: dict[str, Any], build_model: Callable[[dict[str, Any]], Any]) -> dict[str, float]:
    """Forward+backward as bt computes it, in this process's cuBLAS workspace (see --workspace)."""
    import torch

    sys.path.insert(0, spec["src"])
    from buildtrain.executor.process import numerics

    device = torch.device(spec["device"])
    numerics.apply_after_import(torch, "native", device.type, 1)
    torch.use_deterministic_algorithms(True, warn_only=not spec["pinned"])  # a torch that needs it warns
    model = build_model({**spec, "model": "buildtrain"}).to(device)
    pinned = os.environ.get("CUBLAS_WORKSPACE_CONFIG") == WORKSPACE["CUBLAS_WORKSPACE_CONFIG"]
    return {"ms": median(samples(forward_backward_of(model, spec, device), device)), "pinned": pinned}


def timed(work: Callable[[], Any], device: Any) -> float:
    """Median milliseconds of `work` (see `samples`)."""
    return median(samples(work, device))


def samples(work: Callable[[], Any], device: Any, warmup: int = 3, count: int = 20) -> list[float]:
    """Milliseconds of each call of `work` after the warm-up, the device synchronized before and
    after each."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    found = []
    for index in range(warmup + count):
        sync()
        started = time.perf_counter()
        work()
        sync()
        if index >= warmup:
            found.append(1000 * (time.perf_counter() - started))
    return found


def child_json(script: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    """Run `script --child SPEC` in a fresh process; its last line, as JSON."""
    done = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"the child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report_parts(script: str, space: Workspace, base: dict[str, Any], add: Callable[..., None]) -> None:
    """The parts of bt's update timed apart in one fresh process with bt's numerics environment,
    and what they add up to beyond the plain loop's own parts."""
    note("timing the parts of bt's update")
    space.import_buildtrain()
    from buildtrain.executor.process import numerics

    environment = numerics.environment("native", base["device"], 1)  # the step process's
    times = child_json(script, {**base, "parts": True}, space.env(**environment))
    for name, ms in times.items():
        add(f"part: {name}", 1, ms, unit="ms")
    print_table(
        f"bt's update, part by part (ms, median of 20; {json.dumps(base['shape'])})",
        ["part", "ms"],
        [[name, f"{ms:.2f}"] for name, ms in times.items()],
    )
    before, after = (times[k] for k in times if k.startswith("record of 124M"))
    print(f"the record of 124M parameters: fingerprints / blake3 on the host = {ratio(after, before):.3f}")
    optimizer = next(name for name in times if name.startswith("AdamW, torch"))
    extra = {
        "deterministic mode": times["forward+backward, deterministic (bt)"]
        - times["forward+backward, determinism off"],
        "buildtrain's AdamW": times["AdamW, buildtrain (bt)"] - times[optimizer],
        "gradient vector": times["gradient vector and back (bt)"],
        "per-update record": times["per-update record (bt)"],
    }
    print(
        "what bt adds to the plain loop's update (ms): "
        + ", ".join(f"{k} {v:+.2f}" for k, v in extra.items())
    )


def report_workspace(
    script: str,
    space: Workspace,
    base: dict[str, Any],
    rounds: int,
    deadline: float | None,
    add: Callable[..., None],
) -> None:
    """Forward+backward with and without the cuBLAS workspace variable, fresh processes alternated."""
    note("forward+backward with and without CUBLAS_WORKSPACE_CONFIG, fresh processes alternated")
    inherited = {k: v for k, v in space.env().items() if k not in WORKSPACE}

    def contender(pinned: bool) -> Callable[[], float]:
        env = {**inherited, **(WORKSPACE if pinned else {})}

        def measure() -> float:
            found = child_json(script, {**base, "workspace": True, "pinned": pinned}, env)
            if found["pinned"] != pinned:  # the comparison would be of one setting with itself
                raise RuntimeError(f"the child saw the workspace variable {'unset' if pinned else 'set'}")
            return found["ms"]

        return measure

    names = ("forward+backward, CUBLAS_WORKSPACE_CONFIG=:4096:8", "forward+backward, torch's workspace")
    contenders = [(names[0], contender(True)), (names[1], contender(False))]
    add_ms = lambda name, round_, value: add(name, round_, value, unit="ms")  # noqa: E731
    results = alternate(contenders, rounds, warmup=0, on_value=add_ms, deadline=deadline)
    n = min(len(values) for values in results.values())
    print_table(
        f"forward+backward, deterministic (ms; median of {n} fresh process(es) each, alternated)",
        ["cuBLAS workspace", "ms", "min..max"],
        [[name, f"{median(v):.2f}", f"{min(v):.2f}..{max(v):.2f}"] for name, v in results.items()],
    )
    pinned_over_default = ratio(median(results[names[0]]), median(results[names[1]]))
    label = "one sample each" if n == 1 else f"median of {n}"
    print(
        f"pinned workspace / torch's workspace: {pinned_over_default:.3f} ({label}; below 1: the pin is faster)"
    )
    if base["device"] == "cpu":
        print("on the CPU cuBLAS is not used: this run checks the script, not the setting")


def profile_child(spec: dict[str, Any], build_model: Callable[[dict[str, Any]], Any]) -> dict[str, float]:
    """Forward+backward in three stages of one process (see --profile): the plain loop's (torch's
    defaults, its own loss), bt's loss with torch's defaults, and bt's under the step process's
    settings (`numerics.apply_after_import`, deterministic). Each is timed before anything is
    profiled (a profiler, once attached, slows what runs after it), then profiled; prints each
    stage's top kernels and the kernels whose time differs most between the first and the last,
    and returns each stage's median milliseconds, untraced."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, spec["src"])
    from buildtrain.executor.process import numerics

    device = torch.device(spec["device"])
    model = build_model({**spec, "model": "buildtrain"}).to(device)
    bt_pass = forward_backward_of(model, spec, device)
    stages = {"plain loop": forward_backward_of(model, spec, device, loss=plain_loss(F))}
    stages["bt's loss, torch defaults"] = bt_pass
    ours = "bt (settings, deterministic)"
    defaults = torch_settings(torch)
    found = {name: median(samples(work, device, count=10)) for name, work in stages.items()}
    settings = numerics.apply_after_import(torch, "native", device.type, 1)
    print(f"the step process's settings: {settings}", flush=True)
    found[ours] = median(samples(bt_pass, device, count=10))
    kernels = {ours: profiled(ours, found[ours], bt_pass, device)}
    torch_settings(torch, defaults)
    for name, work in stages.items():
        kernels[name] = profiled(name, found[name], work, device)
    print_kernel_differences(kernels["plain loop"], kernels[ours])
    return found


def torch_settings(torch: Any, restore: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings `numerics.apply_after_import` changes, as they are; with `restore`, set back."""
    places = {
        "cudnn.benchmark": (torch.backends.cudnn, "benchmark"),
        "cudnn.deterministic": (torch.backends.cudnn, "deterministic"),
        "cudnn.allow_tf32": (torch.backends.cudnn, "allow_tf32"),
        "matmul.allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
        "fill_uninitialized_memory": (torch.utils.deterministic, "fill_uninitialized_memory"),
    }
    if restore is not None:
        for name, (owner, attribute) in places.items():
            setattr(owner, attribute, restore[name])
        torch.use_deterministic_algorithms(restore["deterministic_algorithms"])
        torch.set_num_threads(restore["threads"])
    found = {name: getattr(owner, attribute) for name, (owner, attribute) in places.items()}
    found["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    found["threads"] = torch.get_num_threads()
    return found


def plain_loss(F: Any) -> Callable[..., Any]:
    """The plain loop's loss (benchmarks/gpu.py `timed_updates`)."""
    return lambda logits, targets, mask: F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def profiled(name: str, ms: float, work: Callable[[], None], device: Any, count: int = 5) -> dict[str, float]:
    """The device ms per call of each kernel of `work` under torch.profiler; its top ones are
    printed beside `ms`, its time untraced."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as trace:
        for _ in range(count):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize()
    per_call: dict[str, float] = {}
    for event in trace.key_averages():
        total = getattr(event, "self_device_time_total", None)
        if total is None:
            total = getattr(event, "self_cuda_time_total", 0.0)
        if device.type == "cpu":
            total = event.self_cpu_time_total
        if total:
            per_call[event.key] = total / 1000 / count
    top = sorted(per_call.items(), key=lambda item: -item[1])[:12]
    print(f"-- {name}: {ms:.2f} ms per forward+backward (median of 10, untraced); top kernels, ms per call:")
    for key, value in top:
        print(f"   {value:8.3f}  {key[:110]}")
    print(flush=True)
    return per_call


def print_kernel_differences(plain: dict[str, float], bt: dict[str, float]) -> None:
    """The 15 kernels whose ms per call differ most between the plain loop and bt."""
    keys = set(plain) | set(bt)
    rows = sorted(keys, key=lambda key: -abs(bt.get(key, 0.0) - plain.get(key, 0.0)))[:15]
    print("-- kernels that differ most, ms per call (bt - plain: bt, plain):")
    for key in rows:
        a, b = bt.get(key, 0.0), plain.get(key, 0.0)
        print(f"   {a - b:+8.3f}  ({a:.3f}, {b:.3f})  {key[:100]}")
    print(flush=True)


def report_profile(script: str, space: Workspace, base: dict[str, Any], add: Callable[..., None]) -> None:
    """--profile: the profile child in bt's step-process environment, its tables printed as they come."""
    note("profiling forward+backward: the plain loop's, then bt's")
    space.import_buildtrain()
    from buildtrain.executor.process import numerics

    environment = numerics.environment("native", base["device"], 1)
    for name, ms in echoed_child(script, {**base, "profile": True}, space.env(**environment)).items():
        add(f"profile: {name}", 1, ms, unit="ms")


def echoed_child(script: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    """Run `script --child SPEC` in a fresh process, printing its lines as it ends (its error
    goes to the terminal as it comes); its last line, as JSON."""
    done = subprocess.run(
        [sys.executable, script, "--child", json.dumps(spec)], env=env, stdout=subprocess.PIPE, text=True
    )
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    if done.returncode != 0 or not lines:
        raise RuntimeError("the child process failed (its error is above)")
    return json.loads(lines[-1])


def architecture_child(
    spec: dict[str, Any], build_model: Callable[[dict[str, Any]], Any]
) -> dict[str, float]:
    """--architecture: forward+backward (torch's defaults, no determinism, the plain loop's loss)
    of the reference GPT and of buildtrain's Transformer with one part at a time swapped for the
    reference's (LayerNorm for RMSNorm, a GELU MLP of 4 x width for SwiGLU, q/k/v as views of the
    projection with no rotation for RoPE), then all three: which part of the architecture the
    plain loop's distance to the reference comes from. Alternated, 3 rounds of 5 each; then the
    kernels that differ most between the reference and buildtrain's model."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, spec["src"])
    device = torch.device(spec["device"])
    width = spec["shape"]["dim"]
    variants = {
        "reference GPT": {"model": "reference"},
        "buildtrain": {},
        "buildtrain, LayerNorm": {"norm": "layernorm"},
        "buildtrain, GELU MLP": {"mlp": "gelu", "hidden": 4 * width},
        "buildtrain, no RoPE": {"rope": False},
        "buildtrain, all three": {"norm": "layernorm", "mlp": "gelu", "hidden": 4 * width, "rope": False},
    }
    passes = {}
    for name, change in variants.items():
        shape = {**spec["shape"], "hidden": change.get("hidden", spec["shape"]["hidden"])}
        model = build_model({**spec, "shape": shape, "model": change.get("model", "buildtrain"), **change})
        if change.get("rope") is False:
            for block in model.blocks:
                block.attention.qkv = unrotated_qkv(block.attention)
        passes[name] = forward_backward_of(model.to(device), spec, device, loss=plain_loss(F))
    found: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(3):
        for name, work in passes.items():
            found[name] += samples(work, device, count=5)
    times = {name: median(values) for name, values in found.items()}
    for name, ms in times.items():
        print(f"   {ms:8.2f} ms  {name}", flush=True)
    kernels = {
        name: profiled(name, times[name], passes[name], device) for name in ("reference GPT", "buildtrain")
    }
    print_kernel_differences(kernels["reference GPT"], kernels["buildtrain"])
    return times


def unrotated_qkv(attention: Any) -> Callable[..., Any]:
    """q, k and v as views of the fused projection, as the reference takes them: no RoPE."""

    def qkv(x: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
        B, T, _ = x.shape
        projection = attention.wqkv(x).view(B, T, -1, attention.head_dim)
        nh, qk = attention.n_heads, attention.n_heads + attention.n_kv_heads
        parts = (projection[:, :, :nh], projection[:, :, nh:qk], projection[:, :, qk:])
        return tuple(part.transpose(1, 2) for part in parts)

    return qkv


def report_architecture(
    script: str, space: Workspace, base: dict[str, Any], add: Callable[..., None]
) -> None:
    """--architecture: the child in a fresh process with torch's defaults, its lines as they come."""
    note("forward+backward of the reference and of buildtrain's model, one part swapped at a time")
    times = echoed_child(script, {**base, "architecture": True}, space.env())
    for name, ms in times.items():
        add(f"architecture: {name}", 1, ms, unit="ms")
    reference = times["reference GPT"]
    print_table(
        "forward+backward by architecture (ms, median of 15, torch's defaults, plain loss)",
        ["model", "ms", "vs reference"],
        [[name, f"{ms:.2f}", f"{ms / reference:.3f}x"] for name, ms in times.items()],
    )

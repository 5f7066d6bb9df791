"""What Triton makes of lineattn's Pallas Triton kernels for an H200, without a GPU: each kernel's registers, spills
and shared memory, its counts of global loads and stores, barriers and shuffles, how many of its 128-bit loads come
before its first shuffle or barrier (all of them, for a kernel that loads, reduces and stores in one trip to memory),
and with --sequence their order in the machine code.

    python3.12 -m venv .venv-triton && .venv-triton/bin/pip install triton==3.6.0   # once (about 650 MB)
    PYTHONPATH=. .venv/bin/python scripts/triton_sass.py decode:64x4f decode:64x4fts --sequence
    PYTHONPATH=. .venv/bin/python scripts/triton_sass.py kda-fwd kda-fwdbwd --keep /tmp/sass

The kernels are lowered as on the lent H200 (JAX 0.11.2's Pallas Triton lowering, sm_90a faked as in the tests'
`fake_h200`, the Mosaic GPU paths taken; shapes as the bench's: H = 16, K = V = 128, bf16, (B, T) = (8, 4096)), and
their Triton IR is compiled by upstream Triton 3.6 (the version beside torch on the H200 machine) and its ptxas,
in a second Python (--triton-python; Triton is no dependency of lineattn). XLA compiles the same IR with the Triton
it bundles, so the figures are a close proxy, not the binary that runs: the decode step with V tiles of 32 takes
72 registers here, as Nsight Compute read on the H200 (run39e), and 126 with tiles of 64 (128 there).

Cases: `decode:<block_v>x<warps><letters>` (the bench's --decode form: f the V tiles first, u readout "updated",
s readout "stored", t state_layout "vk", i v_tiles "strided"), `kda-fwd`, `kda-fwdbwd`, `gdn-fwd`, `gdn-fwdbwd` (every Triton kernel of
the forward or forward+backward; the Mosaic GPU kernels are not Triton's and are skipped).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile

SASS_OPS = r"\b(LDG|STG|BAR|SHFL|LDS|STS|LDSM|STSM|MUFU)[.A-Z0-9]*"


# ---- step 1, in lineattn's Python: lower the cases and keep each Triton kernel's IR ----

def _lower(case: str):
    """[(name, num_warps, num_stages, Triton IR text)] for every Triton kernel the case launches, in program order."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as registration

    from lineattn.ops.pallas import common

    info = gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90a", compute_capability=90)
    saved = registration.gpu_info_lib.get_gpu_info, common.hopper, registration.lowering.lower_jaxpr_to_triton_module
    registration.gpu_info_lib.get_gpu_info = lambda: info
    common.hopper = lambda: True
    texts = {}  # MLIR bytecode -> text: the custom call carries the bytecode, which Triton 3.6 cannot read
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        op = result.module.operation
        buf = io.BytesIO()
        op.write_bytecode(buf)
        texts[buf.getvalue()] = op.get_asm(enable_debug_info=False)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        fn, args = _program(case, jax, jnp)
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:  # (the hooks restored: a test may call this in a process that goes on)
        (registration.gpu_info_lib.get_gpu_info, common.hopper,
         registration.lowering.lower_jaxpr_to_triton_module) = saved
    kernels = []
    for call in hlo.split("custom_call @__gpu$xla.gpu.triton(")[1:]:
        ir_text, rest = _string_at(call, call.index('ir = "') + len("ir = "))
        number = lambda key: int(re.search(rf"\b{key} = (\d+)", rest).group(1))
        name = re.search(r'\bname = "([^"]*)"', rest).group(1)
        kernels.append((name, number("num_warps"), number("num_stages"), texts[_unescape(ir_text)]))
    return kernels


def _string_at(text: str, start: int):
    """The MLIR string literal at text[start] (a double quote), still escaped, and the text after it."""
    i = start + 1
    while text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return text[start + 1:i], text[i + 1:]


def _unescape(s: str) -> bytes:
    """An MLIR string attribute's bytes (\\XX hex escapes)."""
    out, i = bytearray(), 0
    while i < len(s):
        if s[i] == "\\" and re.fullmatch(r"[0-9A-Fa-f]{2}", s[i + 1:i + 3]):
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
        elif s[i] == "\\":
            out.extend(s[i + 1].encode())
            i += 2
        else:
            out.extend(s[i].encode())
            i += 1
    return bytes(out)


def _program(case: str, jax, jnp):
    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 8, 4096, 16, 128, 128
    if case.startswith("decode:"):
        from lineattn.ops.pallas.decode import decode_step
        bench = _bench_module()
        block_v, warps, letters = bench.parse_decode_config(case.removeprefix("decode:"))
        if "c" in letters:
            raise ValueError(f"a decode case reads the decode step, not the copy ('c'), got {case!r}")
        options = bench.decode_options(block_v, warps, letters)
        B, T = 256, 1
        args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
                S((B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16),
                S((B, H, V, K) if options["state_layout"] == "vk" else (B, H, K, V), jnp.float32))
        return (lambda *a: decode_step(*a, interpret=False, **options)), args
    rule, _, mode = case.partition("-")
    if rule not in ("kda", "gdn") or mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"a case is decode:..., kda-fwd, kda-fwdbwd, gdn-fwd or gdn-fwdbwd, got {case!r}")
    from lineattn.ops.pallas.chunk import chunk_pallas
    g = S((B, T, H) if rule == "gdn" else (B, T, H, K), jnp.float32)
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16), g,
            S((B, T, H), jnp.bfloat16), S((B, H, K, V), jnp.float32))

    def loss(*a):
        o, ht = chunk_pallas(*a, K**-0.5, 64, False, "kernels-saved")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    return (jax.value_and_grad(loss, argnums=tuple(range(6))) if mode == "fwdbwd" else loss), args


def _bench_module():
    """benchmarks/bench_pallas_kda.py (its decode_options reads the --decode letters; benchmarks/ is no package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_pallas_kda.py")
    spec = importlib.util.spec_from_file_location("bench_pallas_kda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- step 2, in Triton's Python: compile each kernel for sm_90a and read what ptxas made of it ----

def _compile(folder: str, sequence: bool):
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    tools = os.path.join(os.path.dirname(sys.modules[CUDABackend.__module__].__file__), "bin")
    for entry in json.load(open(os.path.join(folder, "kernels.json"))):
        path = os.path.join(folder, entry["file"])
        options = backend.parse_options(dict(num_warps=entry["num_warps"], num_stages=entry["num_stages"]))
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ir.parse_mlir_module(path, context)
        module.context = context
        metadata = {}
        module = backend.make_ttir(module, metadata, options, 90)
        module = backend.make_ttgir(module, metadata, options, 90)
        open(path + ".ttgir", "w").write(str(module))
        ptx = backend.make_ptx(backend.make_llir(module, metadata, options, 90), metadata, options, 90)
        open(path + ".ptx", "w").write(ptx)
        info = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", path + ".ptx", "-o",
                               path + ".cubin"], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path + ".cubin"], capture_output=True,
                              text=True, check=True).stdout
        open(path + ".sass", "w").write(sass)
        registers, spill_stores, spill_loads = (int((re.search(pattern, info) or [0, 0])[1]) for pattern in (
            r"Used (\d+) registers", r"(\d+) bytes spill stores", r"(\d+) bytes spill loads"))
        ops = [m.group(0) for m in re.finditer(SASS_OPS, sass)]
        counts = " ".join(f"{op} {sum(o.startswith(op) for o in ops)}" for op in ("LDG", "STG", "BAR", "SHFL", "LDS",
                                                                                    "STS"))
        # (the 128-bit global loads, a tile's, issued before the first exchange between threads: a kernel that
        # loads, reduces and stores wants them all there, one trip to memory a program)
        first_exchange = next((i for i, op in enumerate(ops) if op.startswith(("SHFL", "BAR"))), len(ops))
        wide = [i for i, op in enumerate(ops) if op == "LDG.E.128"]
        print(f"{entry['name']:<40s} warps {entry['num_warps']} stages {entry['num_stages']}: {registers} registers, "
              f"spills {spill_stores} / {spill_loads} bytes, shared {metadata.get('shared', 0)} bytes; {counts}; "
              f"128-bit LDG before the first SHFL or BAR {sum(i < first_exchange for i in wide)} of {len(wide)}")
        if sequence:  # runs of the same instruction, in program order
            runs = [[op, 1] for op in ops[:1]]
            for op in ops[1:]:
                if op == runs[-1][0]:
                    runs[-1][1] += 1
                else:
                    runs.append([op, 1])
            print("    " + " | ".join(f"{op} x{n}" for op, n in runs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", help="decode:<block_v>x<warps><letters>, kda-fwd, kda-fwdbwd, gdn-fwd, ...")
    p.add_argument("--triton-python", default=".venv-triton/bin/python",
                   help="a Python with triton==3.6.0 installed (step 2)")
    p.add_argument("--sequence", action="store_true", help="also print each kernel's SASS loads, stores, barriers "
                                                           "and shuffles in program order")
    p.add_argument("--keep", help="a folder for each kernel's Triton IR, TTGIR, PTX and SASS (default: temporary)")
    p.add_argument("--compile", help=argparse.SUPPRESS)  # step 2's entry: the folder step 1 wrote
    a = p.parse_args()
    if a.compile:
        return _compile(a.compile, a.sequence)
    if not a.cases:
        p.error("name at least one case")
    if not os.path.exists(a.triton_python):
        p.error(f"--triton-python {a.triton_python} does not exist: create it with `python3.12 -m venv .venv-triton "
                f"&& .venv-triton/bin/pip install triton==3.6.0`")
    folder = a.keep or tempfile.mkdtemp(prefix="triton_sass_")
    os.makedirs(folder, exist_ok=True)
    for case in a.cases:
        kernels = _lower(case)
        entries = []
        for i, (name, warps, stages, text) in enumerate(kernels):
            file = "_".join([re.sub(r"\W+", "_", case), f"{i:02d}", name]) + ".ttir"
            open(os.path.join(folder, file), "w").write(text)
            entries.append(dict(name=name, num_warps=warps, num_stages=stages, file=file))
        json.dump(entries, open(os.path.join(folder, "kernels.json"), "w"))
        print(f"== {case}: {len(kernels)} Triton kernels", flush=True)
        subprocess.run([a.triton_python, os.path.abspath(__file__), "--compile", folder]
                       + ["--sequence"] * a.sequence, check=True)
    if not a.keep:
        print(f"(files in {folder})")


if __name__ == "__main__":
    main()

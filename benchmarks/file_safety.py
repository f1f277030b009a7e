"""The file-safety probes of the security review: each case as an attacker or a careless user would try it.

``python -m benchmarks.file_safety [--root CHECKOUT ...]`` runs every probe against each checkout (default:
this one) in fresh processes whose ``import amppass`` resolves to that checkout, and prints a markdown table
(case, then one outcome column per checkout). Comparing an old checkout with this one gives the before/after
table of the review. ``--memory`` adds the peak resident memory of the CLI converting a 1 GiB inline model
and a 2.25 GiB external-data model (slow: a few minutes, ~8 GiB of disk).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

# Shared by every probe: a 64x64 MatMul model whose weight W can live in an external file.
_PRELUDE = textwrap.dedent('''
    import json, os, sys, threading
    from pathlib import Path
    import numpy as np, onnx
    from onnx import TensorProto, helper, numpy_helper
    import amppass
    tmp = Path(sys.argv[1])
    SECRET = b"TOP-SECRET-" * 4096
    W = (np.random.default_rng(0).standard_normal((64, 64)) * 0.1).astype(np.float32)

    def model(where="initializer"):
        w = numpy_helper.from_array(W, "W")
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
        if where == "initializer":
            g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
        elif where == "constant":
            g = helper.make_graph([helper.make_node("Constant", [], ["W"], name="c", value=w),
                                   helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y])
        else:
            b = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["yb"])], "t", [],
                                  [helper.make_tensor_value_info("yb", TensorProto.FLOAT, [2, 64])], [w])
            e = helper.make_graph([helper.make_node("Identity", ["x"], ["ye"])], "e", [],
                                  [helper.make_tensor_value_info("ye", TensorProto.FLOAT, [2, 64])])
            g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=b, else_branch=e)], "g",
                                  [x, helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [y])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 10
        return m

    def external(where="initializer", location="w.data", **fields):
        m = model(where)
        from amppass.onnx.io.weight_store import tensors
        t = next(t for t in tensors(m.graph) if t.name == "W")
        (tmp / "w.data").write_bytes(t.raw_data)
        t.ClearField("raw_data"); t.data_location = TensorProto.EXTERNAL
        for k, v in {"location": location, "offset": "0", **fields}.items():
            t.external_data.add(key=k, value=v)
        (tmp / "m.onnx").write_bytes(m.SerializeToString())
        return tmp / "m.onnx"

    def leaked(converted):
        """Whether the converted weight holds anything but W (rounded): bytes read from elsewhere."""
        from amppass.onnx.io.weight_store import tensors
        t = next(t for t in tensors(converted.graph) if t.name.startswith("W"))
        values = numpy_helper.to_array(t).astype(np.float32)
        return not np.allclose(values, W, atol=1e-3)

    def checker_verdict(m):
        """Convert ``m`` and say whether onnx.checker accepts the result."""
        c = amppass.convert_onnx(m)
        try:
            onnx.checker.check_model(c); return "converted; checker accepts it"
        except Exception:
            return "converted into a model the checker rejects"

    def outcome(call):
        try:
            result = call()
        except BaseException as err:
            kind = type(err).__name__
            from amppass import AmpPassError
            tag = "AmpPassError " if isinstance(err, AmpPassError) else "raw "
            return tag + kind + ": " + " ".join(str(err).split())[:90]
        return result
''')

PROBES: dict[str, str] = {
    "external data at an absolute path (initializer)": '''
        def go():
            c = amppass.convert_onnx(str(external(location=str(tmp.parent / "outside" / "secret"))))
            return "converted; " + ("weight read from the outside file" if leaked(c) else "no leak")
        (tmp.parent / "outside").mkdir(); (tmp.parent / "outside" / "secret").write_bytes(SECRET)
        print(outcome(go))''',
    "external data climbing out (../) in a Constant node": '''
        (tmp.parent / "outside").mkdir(); (tmp.parent / "outside" / "secret").write_bytes(SECRET)
        def go():
            c = amppass.convert_onnx(str(external("constant", location="../outside/secret")))
            return "converted; " + ("weight read from the outside file" if leaked(c) else "no leak")
        print(outcome(go))''',
    "link inside the folder pointing outside, in an If body": '''
        (tmp.parent / "outside").mkdir(); (tmp.parent / "outside" / "secret").write_bytes(SECRET)
        (tmp / "link.data").symlink_to(tmp.parent / "outside" / "secret")
        def go():
            c = amppass.convert_onnx(str(external("body", location="link.data")))
            return "converted; " + ("weight read from the outside file" if leaked(c) else "no leak")
        print(outcome(go))''',
    "CLI: data file swapped for a link while converting (12 runs)": '''
        import subprocess, time
        (tmp.parent / "outside").mkdir(); (tmp.parent / "outside" / "secret").write_bytes(SECRET)
        path = external()
        good = (tmp / "w.data").read_bytes()
        leaks = fails = 0
        for run in range(12):
            (tmp / "w.data").unlink(missing_ok=True); (tmp / "w.data").write_bytes(good)
            stop = threading.Event()
            def swap():
                while not stop.is_set():
                    os.replace(tmp / "w.data", tmp / "keep.data")
                    os.symlink(tmp.parent / "outside" / "secret", tmp / "swap.link")
                    os.replace(tmp / "swap.link", tmp / "w.data")
                    time.sleep(0.002)
                    os.replace(tmp / "keep.data", tmp / "w.data")
                    time.sleep(0.002)
            t = threading.Thread(target=swap); t.start()
            done = subprocess.run([sys.executable, "-m", "amppass", "convert", str(path), "-o", str(tmp / "o.onnx")],
                                  capture_output=True, text=True)
            stop.set(); t.join()
            if done.returncode == 0:
                leaks += leaked(onnx.load(tmp / "o.onnx"))
            else:
                fails += 1
            (tmp / "o.onnx").unlink(missing_ok=True)
        print(f"{leaks} of 12 leaked outside bytes; {fails} refused")''',
    "CLI: --report fails (disk full) after the model was written": '''
        from amppass import cli
        src = tmp / "m.onnx"; src.write_bytes(model().SerializeToString())
        out = tmp / "out.onnx"; out.write_bytes(b"previous model")
        real = os.open
        def full(name, *a, **k):
            if "r.html" in os.path.basename(str(name)):
                raise OSError(28, "No space left on device", str(name))
            return real(name, *a, **k)
        os.open = full
        import io, contextlib
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["convert", str(src), "-o", str(out), "--report", str(tmp / "r.html")])
        os.open = real
        kept = out.exists() and out.read_bytes() == b"previous model"
        names = "names r.html" if "r.html" in err.getvalue().split("No space")[0] else "names another file"
        print(f"exit {code}; previous out.onnx {'kept' if kept else 'LOST'}; message {names}")''',
    "save killed between writing the data and the model": '''
        from amppass.onnx.io.save import save
        old = model(); old.graph.initializer.insert(0, numpy_helper.from_array(np.zeros(4096, np.float32), "pad"))
        path = tmp / "out.onnx"
        save(old, path, external_data=True)
        new = model(); new.graph.initializer[0].CopyFrom(numpy_helper.from_array(-W, "W"))
        real = os.replace
        def die(src, dst):
            real(src, dst)
            os._exit(3)  # the process dies right after its first rename
        os.replace = die
        pid = os.fork()
        if pid == 0:
            save(new, path, external_data=True)
            os._exit(0)
        os.waitpid(pid, 0)
        os.replace = real
        import onnxruntime as ort
        x = np.ones((2, 64), np.float32)
        try:
            y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            state = "old model whole" if np.allclose(y, x @ W, atol=1e-4) else (
                "new model whole" if np.allclose(y, x @ -W, atol=1e-4) else "WRONG VALUES")
        except Exception as err:
            state = "model unreadable: " + str(err)[:60]
        print(state)''',
    "4 threads calling amppass.convert at once (12 calls)": '''
        import torch
        sys.path.insert(0, os.getcwd())
        from models import build
        cases = [build(n) for n in ("mlp", "cnn", "bert", "gpt2")]
        errors = []
        def work(c):
            for _ in range(3):
                try:
                    amppass.convert(c.model, c.example_inputs, "bf16")
                except Exception as e:
                    errors.append(type(e).__name__)
        ts = [threading.Thread(target=work, args=(c,)) for c in cases]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(f"{len(errors)} of 12 failed" + (f" ({errors[0]})" if errors else ""))''',
    "external offset past the end of the file":
        '''print(outcome(lambda: amppass.convert_onnx(str(external(offset="999999"))) and "converted"))''',
    "negative external offset":
        '''print(outcome(lambda: amppass.convert_onnx(str(external(offset="-8"))) and "converted"))''',
    "external offset that is not a number":
        '''print(outcome(lambda: amppass.convert_onnx(str(external(offset="12abc"))) and "converted"))''',
    "raw_data shorter than the shape": '''
        m = model(); m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]
        print(outcome(lambda: amppass.convert_onnx(m) and "converted"))''',
    "If nested 2000 deep (in memory)": '''
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
        leaf = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "leaf", [], [out])
        m = helper.make_model(helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [out]),
              opset_imports=[helper.make_opsetid("", 17)])
        g = m.graph
        for i in range(2000):
            n = g.node.add(op_type="If", input=["c"], output=["y"], name=f"if{i}")
            n.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH).g.CopyFrom(leaf)
            g = n.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH).g
            g.name = f"b{i}"; g.output.add().CopyFrom(out)
        g.node.add().CopyFrom(leaf.node[0])
        print(outcome(lambda: amppass.convert_onnx(m) and "converted"))''',
    "forged report metadata: casts = 1e999": '''
        c = amppass.convert_onnx(model())
        e = next(p for p in c.metadata_props if p.key == "amppass")
        e.value = e.value.replace('"casts": ', '"casts": 1e999, "x": ')
        print(outcome(lambda: amppass.report(c).summary() and "reported"))''',
    "forged report metadata: not JSON": '''
        c = amppass.convert_onnx(model())
        next(p for p in c.metadata_props if p.key == "amppass").value = "{oops"
        print(outcome(lambda: amppass.report(c).summary() and "reported"))''',
    "forged node metadata: precision missing": '''
        c = amppass.convert_onnx(model())
        n = next(n for n in c.graph.node if n.op_type == "MatMul")
        next(p for p in n.metadata_props if p.key == "amppass").value = '{"op": "MatMul"}'
        print(outcome(lambda: amppass.report(c).summary() and "reported"))''',
    "initializer at the store's reserved location": '''
        m = model()
        b = onnx.TensorProto(name="B", data_type=TensorProto.FLOAT, dims=[64], data_location=TensorProto.EXTERNAL)
        for k, v in (("location", "amppass:weight-store"), ("offset", "0"), ("length", "256")):
            b.external_data.add(key=k, value=v)
        m.graph.initializer.append(b); m.graph.input.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [64]))
        m.graph.node.append(helper.make_node("Add", ["y", "B"], ["z"], name="add")); m.graph.output[0].name = "z"
        def go():
            c = amppass.convert_onnx(m)
            vals = numpy_helper.to_array(next(t for t in c.graph.initializer if t.name == "B"))
            took_w = vals.size and abs(float(vals[0]) - float(W.flat[0])) < 1e-2
            return "converted; B silently took W's values" if took_w else "converted"
        print(outcome(go))''',
    "graph with a cycle": '''
        m = model(); m.graph.node.append(helper.make_node("Relu", ["y"], ["x2"], name="back"))
        m.graph.node[0].input[0] = "x2"
        print(outcome(lambda: checker_verdict(m)))''',
    "two nodes writing one output": '''
        m = model(); m.graph.node.append(helper.make_node("Neg", ["x"], ["y"], name="again"))
        print(outcome(lambda: checker_verdict(m)))''',
    "SIGTERM during save (temporary files left)": '''
        import signal, subprocess, time
        src = tmp / "m.onnx"; src.write_bytes(model().SerializeToString())
        code = ("import sys, time, onnx\\n"
                "import amppass.pipelines.convert_onnx as c\\n"
                "real = onnx.ModelProto.SerializeToString\\n"
                "def slow(self, *a, **k):\\n"
                "    out = real(self, *a, **k); print('saving', flush=True); time.sleep(30); return out\\n"
                "onnx.ModelProto.SerializeToString = slow\\n"
                "from amppass.onnx.io.weight_store import WeightStore\\n"
                "w = WeightStore.write\\n"
                "def slow_w(self, *a):\\n"
                "    w(self, *a); print('saving', flush=True); time.sleep(30)\\n"
                "WeightStore.write = slow_w\\n"
                "c.save(onnx.load(sys.argv[1]), sys.argv[2], external_data=True)\\n")
        p = subprocess.Popen([sys.executable, "-c", code, str(src), str(tmp / "out.onnx")], stdout=subprocess.PIPE,
                             text=True)
        p.stdout.readline(); p.send_signal(signal.SIGTERM); p.wait(60)
        left = sorted(x.name for x in tmp.iterdir() if x.name != "m.onnx")
        print(f"{len(left)} files left" + (f": {', '.join(left)}" if left else ""))''',
    "output model mode under umask 022": '''
        from amppass.onnx.io.save import save
        os.umask(0o022); save(model(), tmp / "o.onnx")
        print(oct((tmp / "o.onnx").stat().st_mode & 0o777))''',
    "CLI: 2 MB .npz expanding to 2 GiB (peak RSS)": '''
        import subprocess, zipfile
        src = tmp / "m.onnx"; src.write_bytes(model().SerializeToString())
        bomb = tmp / "feeds.npz"
        with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
            with z.open("x.npy", "w", force_zip64=True) as f:
                header = {"descr": "<f4", "fortran_order": False, "shape": (8192, 64, 1024)}
                np.lib.format.write_array_header_1_0(f, header)
                zero = bytes(1 << 20)
                for _ in range(2048):
                    f.write(zero)
        run = ("import resource, sys\\nfrom amppass.cli import main\\ncode = main(sys.argv[1:])\\n"
               "print('RSS', code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        done = subprocess.run([sys.executable, "-c", run, "convert", str(src), "-o", str(tmp / "o.onnx"),
                               "--calib", str(bomb)], capture_output=True, text=True)
        line = [l for l in done.stdout.splitlines() if l.startswith("RSS")][-1].split()
        print(f"{bomb.stat().st_size / 1e6:.1f} MB file: exit {line[1]}, peak RSS {int(line[2]) / 1024**2:.2f} GiB")''',
    "calibration feed for a dim_value -1 input": '''
        m = model(); m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
        feeds = [{"x": np.ones((3, 64), np.float32)}]
        print(outcome(lambda: amppass.convert_onnx(m, calibration=feeds) and "calibrated"))''',
}

_MEMORY = textwrap.dedent('''
    import sys
    from pathlib import Path
    import numpy as np, onnx
    from onnx import TensorProto as T, helper, numpy_helper
    tmp = Path(sys.argv[1]); gib = float(sys.argv[2]); external = sys.argv[3] == "external"
    dim = 8192 if external else 4096
    layers = max(1, round(gib * 1024**3 / (dim * dim * 4)))
    weight = (np.random.default_rng(0).standard_normal((dim, dim), dtype=np.float32) / np.float32(np.sqrt(dim)))
    inits, nodes, value = [], [], "x"
    data = open(tmp / "big.onnx.data", "wb") if external else None
    for i in range(layers):
        if external:
            t = onnx.TensorProto(name=f"W{i}", data_type=T.FLOAT, dims=[dim, dim], data_location=T.EXTERNAL)
            for k, v in (("location", "big.onnx.data"), ("offset", str(data.tell())), ("length", str(weight.nbytes))):
                t.external_data.add(key=k, value=v)
            data.write(weight.tobytes())
        else:
            t = numpy_helper.from_array(weight, f"W{i}")
        inits.append(t)
        nodes.append(helper.make_node("MatMul", [value, f"W{i}"], [f"h{i}"], name=f"mm{i}")); value = f"h{i}"
    if data:
        data.close()
    nodes.append(helper.make_node("Relu", [value], ["y"], name="relu"))
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", T.FLOAT, ["n", dim])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["n", dim])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 10
    (tmp / "big.onnx").write_bytes(m.SerializeToString())

''')


# .pt2 archives and the timing cache: a converted MLP saved by amppass.save, edited as an attacker would; the
# payload is a pickle whose __reduce__ writes a marker file (then returns the weight, so the model loads)
_PT2 = textwrap.dedent('''
    import io, zipfile, torch
    MARK = tmp / "marker"

    class Payload:
        def __reduce__(self):
            return eval, (f"(__import__('pathlib').Path({str(MARK)!r}).write_text('ran'), "
                          "__import__('torch').nn.Parameter(__import__('torch').zeros(8, 8, dtype="
                          "__import__('torch').bfloat16), requires_grad=False))[1]",)

    def saved():
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
        amppass.save(amppass.convert(mlp, (torch.ones(2, 8),), "bf16", plan_for="coverage"), tmp / "m.pt2")
        return tmp / "m.pt2"

    def edited(edit):
        with zipfile.ZipFile(saved()) as z:
            root = z.namelist()[0].partition("/")[0]
            entries = {i.filename.partition("/")[2]: z.read(i) for i in z.infolist()}
        edit(entries)
        with zipfile.ZipFile(tmp / "evil.pt2", "w") as z:
            for name, data in entries.items():
                z.writestr(f"{root}/{name}", data)
        return tmp / "evil.pt2"

    def pickled_weight(entries):
        config = json.loads(entries["data/weights/model_weights_config.json"])
        meta = config["config"]["0.weight"]
        meta["use_pickle"] = True
        buffer = io.BytesIO(); torch.save(Payload(), buffer)
        entries["data/weights/" + meta["path_name"]] = buffer.getvalue()
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()

    def sympy_size(entries):
        text = entries["models/model.json"].decode()
        start = text.index('"expr_str": "') + 12
        end = text.index('"', start + 1) + 1
        code = f"open({str(MARK)!r}, 'w').write('ran')"
        entries["models/model.json"] = (text[:start] + json.dumps(code) + text[end:]).encode()

    def ran(call):
        result = outcome(call)
        return ("CODE FROM THE FILE RAN; " if MARK.exists() else "") + result

    def within(seconds, call):
        done = []
        worker = threading.Thread(target=lambda: done.append(outcome(call)), daemon=True)
        worker.start(); worker.join(seconds)
        return done[0] if done else f"hangs (no answer in {seconds} s)"

    def cache(folder):
        from amppass.targets.timing_cache import TimingCache
        return TimingCache({"device": "cpu", "probe": 1}, folder)
''')

def _pt2(body: str) -> str:
    """A probe's code: the .pt2 and cache helpers, then ``body``."""
    return _PT2 + textwrap.dedent(body)


PROBES.update({
    ".pt2: weight stored as a pickle (amppass.load)": _pt2('''
        evil = edited(pickled_weight)
        print(ran(lambda: type(amppass.load(evil)).__name__ + " loaded"))'''),
    ".pt2: weight stored as a pickle (amppass report)": _pt2('''
        import subprocess
        evil = edited(pickled_weight)
        def go():
            done = subprocess.run([sys.executable, "-m", "amppass", "report", str(evil)], capture_output=True,
                                  text=True)
            return f"exit {done.returncode}, stderr {len(done.stderr.strip().splitlines())} lines"
        print(ran(go))'''),
    ".pt2: symbolic size that is Python code": _pt2('''
        evil = edited(sympy_size)
        print(ran(lambda: type(amppass.load(evil)).__name__ + " loaded"))'''),
    ".pt2: plan entry nested 100000 deep": _pt2('''
        evil = edited(lambda e: e.update({"extra/amppass.json": b"[" * 100000 + b"]" * 100000}))
        print(ran(lambda: type(amppass.load(evil)).__name__ + " loaded"))'''),
    "timing cache: nested 200000 deep": _pt2('''
        path = cache(tmp).path
        path.write_text("[" * 200000 + "]" * 200000)
        print(within(30, lambda: f"{len(cache(tmp).entries)} entries"))'''),
    "timing cache: the table is a FIFO": _pt2('''
        os.mkfifo(cache(tmp).path)
        print(within(20, lambda: f"{len(cache(tmp).entries)} entries"))
        sys.stdout.flush(); os._exit(0)'''),
    "timing cache: the lock links outside the folder": _pt2('''
        (tmp.parent / "outside").mkdir()
        c = cache(tmp)
        c.path.with_suffix(".lock").symlink_to(tmp.parent / "outside" / "made")
        result = outcome(lambda: (c.add({"k": 1e-6}), "table written" if c.enabled else "cache skipped")[1])
        made = (tmp.parent / "outside" / "made").exists()
        print(("A FILE WAS CREATED OUTSIDE; " if made else "nothing outside; ") + result)'''),
    "timing cache: the user's notes.json, 100 days old": _pt2('''
        import time
        notes = tmp / "notes.json"; notes.write_text("{}")
        old = time.time() - 100 * 86400; os.utime(notes, (old, old))
        cache(tmp).add({"k": 1e-6})
        print("notes.json kept" if notes.exists() else "NOTES.JSON DELETED")'''),
})


def run_probe(root: Path, name: str) -> str:
    """One probe in a fresh process importing amppass from ``root``; its one-line outcome."""
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder) / "model"
        work.mkdir()
        code = _PRELUDE + textwrap.dedent(PROBES[name])
        done = subprocess.run([sys.executable, "-c", code, str(work)], cwd=root, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if lines:
            return lines[-1]
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"process died (exit {done.returncode}): {tail[:90]}"


_CLI = ("import resource, sys\nfrom amppass.cli import main\ncode = main(sys.argv[1:])\n"
        "print('RSS', code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def run_memory(root: Path, gib: float, external: bool) -> str:
    """Peak RSS of ``amppass convert`` on a generated model, in a process started from this lean one (a child
    forked from the process that generated the model would start with that process's peak)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("AMPPASS_SCALE_DIR")) as folder:
        env = {**os.environ, "PYTHONPATH": str(root)}
        subprocess.run([sys.executable, "-c", _MEMORY, folder, str(gib), "external" if external else "inline"],
                       cwd=root, check=True, env=env, timeout=3600)
        size = sum(p.stat().st_size for p in Path(folder).iterdir()) / 1024**3
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _CLI, "convert", str(Path(folder) / "big.onnx"), "-o",
                               str(Path(folder) / "out.onnx")], cwd=root, capture_output=True, text=True, env=env,
                              timeout=3600)
        line = [entry for entry in done.stdout.splitlines() if entry.startswith("RSS")]
        if not line:
            return f"{size:.2f} GiB model: failed ({(done.stderr.strip().splitlines() or ['?'])[-1][:120]})"
        _, code, rss = line[-1].split()
        peak = int(rss) / 1024**2
        return (f"{size:.2f} GiB model: exit {code}, {time.perf_counter() - start:.1f} s, peak RSS {peak:.2f} GiB "
                f"({peak / size:.2f}x the model)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", type=Path, help="a checkout to probe (repeat to compare)")
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS on 1 and 2.25 GiB models")
    parser.add_argument("--only", help="run only probes whose name contains this text")
    args = parser.parse_args(argv)
    roots = args.root or [HERE]
    names = [n for n in PROBES if not args.only or args.only in n]
    print("| case | " + " | ".join(str(r) for r in roots) + " |")
    print("|---" * (len(roots) + 1) + "|")
    for name in names:
        cells = [run_probe(root, name).replace("|", "\\|") for root in roots]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.memory:
        for gib, external in ((1.0, False), (2.25, True)):
            cells = [run_memory(root, gib, external) for root in roots]
            what = f"CLI convert, {gib:g} GiB {'external-data' if external else 'inline'} model"
            print(f"| {what} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

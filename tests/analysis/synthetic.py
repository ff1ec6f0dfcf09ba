"""Small hand-built Kineto traces for unit tests of one rule each (the real-trace tests are the main ones)."""
import json


class TraceWriter:
    def __init__(self, device="NVIDIA H100 80GB HBM3", sms=132):
        self.events = []
        self.props = [{"id": 0, "name": device, "numSms": sms, "computeMajor": 9, "computeMinor": 0}]
        self.next_id = 1

    def op(self, name, ts, dur, dims=None, types=None, strides=None, tid=1, cat="cpu_op"):
        ext = self.next_id
        self.next_id += 1
        args = {"External id": ext}
        if dims is not None:
            args.update({"Input Dims": dims, "Input type": types or ["c10::BFloat16"] * len(dims),
                         "Input Strides": strides or [[] for _ in dims], "Concrete Inputs": ["" for _ in dims]})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})
        return ext

    def kernel(self, name, ts, dur, ext, stream=7, launch_ts=None, device=0):
        corr = self.next_id
        self.next_id += 1
        launch = ts - 5 if launch_ts is None else launch_ts
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                            "ts": launch, "dur": 3, "args": {"External id": ext, "correlation": corr}})
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": stream, "ts": ts,
                            "dur": dur, "args": {"External id": ext, "correlation": corr, "stream": stream,
                                                 "device": device}})

    def step(self, number, ts, dur, tid=1):
        """A ProfilerStep#N range, as torch.profiler's schedule writes it."""
        self.events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 1,
                            "tid": tid, "ts": ts, "dur": dur, "args": {"External id": self._id()}})

    def runtime(self, name, ts, dur, ext=None, tid=1):
        """A CUDA runtime call that launches nothing (a synchronize)."""
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts,
                            "dur": dur, "args": {"correlation": self._id(), **({"External id": ext} if ext else {})}})

    def _id(self):
        self.next_id += 1
        return self.next_id - 1

    def write(self, path):
        path.write_text(json.dumps({"deviceProperties": self.props, "traceEvents": self.events}))
        return path

"""Make a large trace by tiling a real one in time: `python benchmarks/tile_trace.py IN OUT --events 1000000`.

Each copy is shifted past the previous one, with its correlation / External ids and flow ids offset
so the links stay unique; the result is what a long profiling session of the same model looks like.
"""
import argparse
import gzip
import json


def tile(source: dict, events_wanted: int) -> dict:
    events = source["traceEvents"]
    timed = [e for e in events if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    start = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - start + 100.0
    ids = [e["args"].get(k, 0) for e in events if isinstance(e.get("args"), dict)
           for k in ("correlation", "External id") if isinstance(e["args"].get(k), int)]
    id_step = max(ids + [0]) + 1
    flow_step = max([e["id"] for e in events if isinstance(e.get("id"), int)] + [0]) + 1
    copies = max(1, -(-events_wanted // len(events)))
    out = [e for e in events if e.get("ph") == "M"]
    for c in range(copies):
        for e in events:
            if e.get("ph") == "M":
                continue
            e2 = dict(e)
            if isinstance(e2.get("ts"), (int, float)):
                e2["ts"] = e["ts"] + c * span
            if isinstance(e2.get("id"), int):
                e2["id"] = e["id"] + c * flow_step
            if isinstance(e.get("args"), dict):
                args = dict(e["args"])
                for k in ("correlation", "External id"):
                    if isinstance(args.get(k), int) and args[k] > 0:
                        args[k] += c * id_step
                if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{c * 1000 + int(e['name'].split('#')[1])}"
                e2["args"] = args
            out.append(e2)
    result = dict(source)
    result["traceEvents"] = out
    return result


def write_kineto_layout(document: dict, f) -> None:
    """Write as libkineto does: top-level keys, then one event per block at a two-space indent."""
    f.write("{\n")
    for key, value in document.items():
        if key != "traceEvents":
            f.write(f"  {json.dumps(key)}: {json.dumps(value)},\n")
    f.write('  "traceEvents": [')
    for i, event in enumerate(document["traceEvents"]):
        f.write(("," if i else "") + "\n  " + json.dumps(event))
    f.write("\n  ]\n}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    opener = gzip.open if open(args.source, "rb").read(2) == b"\x1f\x8b" else open
    with opener(args.source, "rt") as f:
        source = json.load(f)
    result = tile(source, args.events)
    out_open = gzip.open if args.out.endswith(".gz") else open
    with out_open(args.out, "wt") as f:
        write_kineto_layout(result, f)
    print(f"{len(result['traceEvents'])} events -> {args.out}")


if __name__ == "__main__":
    main()

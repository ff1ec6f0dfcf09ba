"""The profiler labels and trace metadata that `profiler_svc.capture` writes and the analyser reads.

Kept in one place so the writer (capture) and the reader (trace loading) cannot drift apart.

Module label: a CPU range (any category: the agent writes `cpu_op` ranges, `record_function` writes `user_annotation`) named
``module::<qualified name> (<ClassName>)``, e.g. ``module::model.layers.3.input_layernorm (LlamaRMSNorm)``.
The root module's qualified name is written as ``<root>``.

Metadata: one top-level key ``profiler_svc`` in the trace JSON (``prof.add_metadata_json``),
an object with ``schema`` = METADATA_SCHEMA and the keys documented in docs/capture.md.
"""

MODULE_PREFIX = "module::"
ROOT_NAME = "<root>"
METADATA_KEY = "profiler_svc"
METADATA_SCHEMA = "profiler_svc.capture/1"


def module_label(qualified_name: str, class_name: str) -> str:
    return f"{MODULE_PREFIX}{qualified_name or ROOT_NAME} ({class_name})"


def parse_module_label(name: str):
    """``module::a.b (Cls)`` -> ``("a.b", "Cls")``; None for any other annotation."""
    if not name.startswith(MODULE_PREFIX) or not name.endswith(")"):
        return None
    body = name[len(MODULE_PREFIX):-1]
    qualified_name, sep, class_name = body.rpartition(" (")
    if not sep:
        return None
    return qualified_name, class_name

"""Severity from a finding's estimated saving as a share of the analysed window (no heavy imports: the CLI
parser uses it)."""

SEVERITIES = ("info", "low", "medium", "high")
# share of the analysed window a finding's saving must reach for each severity
_SEVERITY_SHARE = (("high", 0.10), ("medium", 0.03), ("low", 0.005))


def severity_for(savings_us: float, span_us: float) -> str:
    share = savings_us / span_us if span_us > 0 else 0.0
    for name, threshold in _SEVERITY_SHARE:
        if share >= threshold:
            return name
    return "info"

"""The application: the `serve`, `ingest`, `worker`, `db upgrade` and `demo` subcommands, the demo
and the A/B worker loop. It sits on top of everything (web, A/B, capture, storage); nothing below
imports it. See docs/service.md.
"""

"""Benchmarks that print tables (never timed tests), each behind a ``racer`` command or run as
``python -m racer.bench.NAME``. Nothing outside this package imports it (the ``bench-apart`` import
contract; ``racer/cli.py`` names its modules as strings), so a serving image may leave it out.

- ``modes``: ``racer bench``, every drafting mode against HF greedy and prompt lookup, in process;
- ``services``: ``racer bench-stack``, ``bench-batch``, ``bench-snapshot``; ``burst``: ``bench-burst``;
- ``corpus``, ``corpus_stack``: ``racer bench-corpus`` (``--through stack``: drafter replicas apart);
- ``tools``: ``racer bench-tools``, function-calling sessions per tenant;
- ``prefix``: the prefix cache and placement; ``grammar``: grammar libraries on this CPU;
  ``forced``: the grammar's forced tokens in constrained tool calls;
- ``loadgen``: ``racer load``, the bounded load generator.
"""

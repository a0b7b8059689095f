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

What they share, written once: ``harness`` (markdown tables; a stack of service processes with
tenants of their own), ``tiny`` (tiny random-weight models of many families, random prompts and
draft trees), ``reference`` (Hugging Face greedy decoding, the round loop over plain sessions) and
``inproc`` (the three services in this process over loopback gRPC). The scripts in ``scripts/`` and
the tests' ``tests/support`` take these from here.
"""

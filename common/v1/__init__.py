"""Generated gRPC stubs of the racer.v1 protocol (``python -m racer.protos`` rebuilds them)."""

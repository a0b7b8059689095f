"""What the drafter, the verifier and the gateway share: the protocol stubs, settings, the server
skeleton, errors, the session table, the store, and the round. Imports nothing above it."""

"""Ranks as processes: tensor parallelism inside one engine core, and the shared-memory communicator they use."""

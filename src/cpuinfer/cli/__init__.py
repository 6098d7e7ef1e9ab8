"""The `cpuinfer` command line."""

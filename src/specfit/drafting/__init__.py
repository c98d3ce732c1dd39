"""Stage 2, drafting: the EAGLE-3 drafter module, its checkpoint formats (with the files they are read from and the
checks on what is read), the target features it reads, draft trees as plain data, and level-by-level tree drafting.
Depends on ``seam`` only."""

"""The driver: one training segment of a run (`segment.run_training`), built from the roles placed on
Ray (`placement`), wired into the loop (`roles`, `pushes`, `switchboard`: its one wait) and run (`loop`)."""

"""Preparation: what a run needs before any role starts, written once into storage.

The prompt dataset (`dataset`), an imported model (`model_import`), the initial model (`initial_model`)
and the checks that need plug-ins and model specs (`checks`). Sits above the roles whose inputs it
prepares and checks; the driver, evals and the CLI call it.
"""

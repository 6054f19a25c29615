"""Graph passes of the specc pipeline: one module per pass, each ExportedProgram -> ExportedProgram.

This folder is the top-level passes/ of the repository, installed as the package specc.passes
(pyproject.toml's package-dir): import it as `specc.passes`."""

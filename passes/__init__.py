"""Graph passes of the specc pipeline: one module per pass, each ExportedProgram -> ExportedProgram."""

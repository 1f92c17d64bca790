"""The `diloco` command line: one module per subcommand, and the config layering they share."""

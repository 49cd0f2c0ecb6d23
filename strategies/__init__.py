"""memadvisor's built-in strategies, one module each, registered through the entry-point
group ``memadvisor.strategies`` (see pyproject.toml) exactly as a third party's would be."""

"""What the plugin records for tests, the demo and operators: statistics, the routers' choices, and the name of a lost peer."""

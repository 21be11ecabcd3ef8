"""The builder: capacities, export, engines, engine directories."""

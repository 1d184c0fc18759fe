"""`lanelock run`, one turn from argv to exit status: args.py reads the common forms without click,
wrapper.py decides (held, deflected, fallback chain), runner.py supervises the child, launch.py is
the parked child's side, chain.py the fallback entries."""

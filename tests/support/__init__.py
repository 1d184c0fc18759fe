"""What the tests share: stand-ins, helpers and the programs tests start (tests/README.md lists
them). Test modules import helpers from here (conftest.py holds the fixtures only), never from
one another; the programs here stay runnable as files (`python tests/support/store_driver.py
...`) and as modules from tests/ (`python -m support.store_driver ...`)."""

"""Entry points of the daemons and the launcher (installed as `offpolicy.services`)."""

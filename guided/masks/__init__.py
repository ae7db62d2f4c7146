"""A step's grammar masks: the one room that sees both requests and matchers."""

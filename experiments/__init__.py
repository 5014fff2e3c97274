"""Model code under test (ports compared against their references by paritylab)."""

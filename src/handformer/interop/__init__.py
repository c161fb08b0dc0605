"""Bridges to other people's implementations (torch ``nn.*`` today)."""

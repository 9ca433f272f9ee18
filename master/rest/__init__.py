"""The parts of the master's admin REST API: routes per area, security, OpenAPI, status page.

``kvstore.master.admin.init_app`` assembles them into one aiohttp application.
"""

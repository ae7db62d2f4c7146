"""The engine core: add_request / abort_request / step, the step loop, the update, the drafts."""

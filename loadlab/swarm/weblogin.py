"""A web UI that is safe to expose. Locust's UI starts load against any host typed into its form, and binds
on every interface unless told otherwise: loadlab binds it on loopback when nothing else was asked, and
refuses a UI asked to listen beyond loopback without a login, unless ``--web-ui-open`` says the risk is
accepted. The login's credentials come from the environment
(``LOADLAB_WEB_LOGIN=user:password``) or a file (``--web-login-file``), never the command line, and are
never logged or written. docs/web-ui.md, "Login".
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

CREDENTIALS_ENV = "LOADLAB_WEB_LOGIN"  # user:password
LOCUST_DEFAULT_HOSTS = ("*", "", None)  # Locust's --web-host default (every interface), as it spells it
LOGIN_ROUTE = "/loadlab/login"  # where Locust's login form posts (auth_args' username_password_callback)


class WebLoginError(ValueError):
    """A one-line reason the web UI cannot start as configured (the secret itself never in it)."""


def exposed(web_host: str | None) -> bool:
    """The UI binds beyond loopback: all interfaces (Locust's ``*``, empty, 0.0.0.0, ::) or any address or
    name other than a loopback one."""
    host = (web_host or "").strip("[]")
    if host in ("", "*"):
        return True
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it may be reachable from elsewhere
        return True


def read_credentials(login_file: str | None) -> tuple[str, str] | None:
    """(user, password) from ``--web-login-file`` or ``LOADLAB_WEB_LOGIN``; None when neither is set."""
    if login_file:
        try:
            text = Path(login_file).read_text().strip()
        except OSError as e:
            raise WebLoginError(
                f"--web-login-file {login_file}: cannot read it ({e.strerror or e})"
            ) from None
        where = f"--web-login-file {login_file}"
    elif os.environ.get(CREDENTIALS_ENV):
        text, where = os.environ[CREDENTIALS_ENV].strip(), CREDENTIALS_ENV
    else:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise WebLoginError(f"{where}: expected user:password (one line, a non-empty user and password)")
    return user, password


def check_and_install(web_ui, options) -> None:
    """Refuses an exposed UI without a login (unless --web-ui-open), and with --web-login installs a login
    that accepts the configured credentials alone. Raises WebLoginError with the one-line reason."""
    credentials = read_credentials(getattr(options, "web_login_file", None))
    host = options.web_host
    if options.web_login:
        if credentials is None:
            raise WebLoginError(
                f"--web-login: no credentials: set {CREDENTIALS_ENV}=user:password in the environment or give "
                "--web-login-file PATH (never on the command line)"
            )
        _install(web_ui, *credentials)
        return
    if credentials is not None:
        raise WebLoginError(
            f"web UI credentials are set ({CREDENTIALS_ENV} or --web-login-file) but the login is off: add "
            "--web-login"
        )
    if host in LOCUST_DEFAULT_HOSTS and not options.web_ui_open:
        # Locust's default binds every interface; nobody asked for that here, so loopback it is (said once).
        web_ui.host = "127.0.0.1"
        log.info(
            "loadlab: the web UI listens on 127.0.0.1 only (Locust's default, all interfaces, with no login "
            "would let anyone start load): to expose it, --web-host 0.0.0.0 with --web-login"
        )
        return
    if exposed(host) and not options.web_ui_open:
        shown = "all interfaces" if host in ("", "*", None) else host
        raise WebLoginError(
            f"the web UI would listen on {shown} (--web-host {host or '*'}) with no login: anyone who reaches "
            f"port {options.web_port} could start load against any host. Add --web-login with "
            f"{CREDENTIALS_ENV}=user:password, bind it to loopback (--web-host 127.0.0.1), or accept the risk "
            "with --web-ui-open"
        )


class _User:
    """The one account (Flask-Login's user protocol)."""

    is_authenticated = True
    is_active = True
    is_anonymous = False

    def __init__(self, name: str):
        self.name = name

    def get_id(self) -> str:
        return self.name


def _install(web_ui, user: str, password: str) -> None:
    from flask import redirect, request, session, url_for
    from flask_login import login_user

    # A fresh key each start: sessions do not outlive the process, and no key sits in a file or the env.
    web_ui.app.config["SECRET_KEY"] = secrets.token_hex(32)
    web_ui.auth_args = {"username_password_callback": LOGIN_ROUTE}
    web_ui.login_manager.user_loader(lambda name: _User(name) if hmac.compare_digest(name, user) else None)

    def submit():
        given_user = request.form.get("username", "")
        given_password = request.form.get("password", "")
        # Both compared in constant time, so a wrong guess says nothing about which part was wrong.
        good = hmac.compare_digest(given_user.encode(), user.encode())
        good &= hmac.compare_digest(given_password.encode(), password.encode())
        if good:
            login_user(_User(user))
            return redirect(url_for("locust.index"))
        session["auth_error"] = "Invalid username or password"
        return redirect(url_for("locust.login"))

    web_ui.app.add_url_rule(LOGIN_ROUTE, "loadlab_login", submit, methods=["POST"])

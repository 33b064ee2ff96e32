// An OpenID provider for the tests (tests/support/oidc.py): npm's oidc-provider, a certified
// OpenID Connect provider library, configured here and nothing more. Run by Node:
//
//   node oidc_provider.js <folder holding node_modules/oidc-provider> <port> <config.json>
//
// config.json: {"issuer", "resource" (the API's audience), "clients": [...],
// "accounts": {"<sub>": {"email", "name", "groups": [...]}}, "jwks": {"keys": [private JWKs]}}.
// The login and device pages are the library's own development interactions: real HTML forms
// (any password is taken for a known account). POST /__test/config replaces clients, accounts
// or keys (a new Provider on the same storage, so sessions and grants live on): the tests'
// key rotation and group changes. It listens on 127.0.0.1 only and prints "listening" when ready.
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { pathToFileURL } from 'node:url';

const [modulesDir, port, configPath] = process.argv.slice(2);
const { default: Provider, errors } = await import(
  pathToFileURL(`${modulesDir}/node_modules/oidc-provider/lib/index.js`).href
);

const config = JSON.parse(readFileSync(configPath, 'utf8'));
const SCOPES = 'openid email profile offline_access';

function claimsOf(sub) {
  const account = config.accounts[sub] || {};
  return {
    sub,
    email: account.email,
    email_verified: true,
    preferred_username: account.name,
    name: account.name,
    groups: account.groups || [],
  };
}

function build() {
  const provider = new Provider(config.issuer, {
    clients: config.clients,
    jwks: config.jwks,
    cookies: { keys: ['torchyard-test-cookie-key'] },
    claims: {
      openid: ['sub', 'groups'],
      email: ['email', 'email_verified'],
      profile: ['preferred_username', 'name'],
    },
    conformIdTokenClaims: false,
    pkce: { required: () => true, methods: ['S256'] },
    features: {
      devInteractions: { enabled: true },
      deviceFlow: { enabled: true },
      revocation: { enabled: true },
      clientCredentials: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: () => config.resource,
        useGrantedResource: () => true,
        getResourceServerInfo: (ctx, resource) => {
          if (resource !== config.resource && !resource.startsWith('urn:torchyard-test:')) {
            throw new errors.InvalidTarget();
          }
          return { scope: 'api', audience: resource, accessTokenFormat: 'jwt', accessTokenTTL: 3600 };
        },
      },
    },
    findAccount: async (ctx, sub) => {
      if (!config.accounts[sub]) return undefined;
      return { accountId: sub, claims: async () => claimsOf(sub) };
    },
    // The groups and email in the JWT access tokens too: the API reads them from each request.
    extraTokenClaims: async (ctx, token) => {
      if (!token.accountId || !config.accounts[token.accountId]) return undefined;
      const { email, groups } = claimsOf(token.accountId);
      return { email, groups };
    },
    // No consent page: every client here is first-party; every scope and resource asked is granted.
    loadExistingGrant: async (ctx) => {
      const grant = new ctx.oidc.provider.Grant({
        clientId: ctx.oidc.client.clientId,
        accountId: ctx.oidc.session.accountId,
      });
      grant.addOIDCScope(SCOPES);
      grant.addOIDCClaims(['sub', 'groups', 'email', 'email_verified', 'preferred_username', 'name']);
      const resources = new Set([config.resource]);
      const asked = ctx.oidc.params.resource;
      for (const r of Array.isArray(asked) ? asked : asked ? [asked] : []) resources.add(r);
      for (const r of resources) grant.addResourceScope(r, 'api');
      await grant.save();
      return grant;
    },
    issueRefreshToken: async (ctx, client) => client.grantTypeAllowed('refresh_token'),
    ttl: {
      AccessToken: 3600,
      IdToken: 3600,
      RefreshToken: 24 * 3600,
      DeviceCode: 600,
      Grant: 24 * 3600,
      Session: 24 * 3600,
      Interaction: 3600,
    },
  });
  provider.on('server_error', (ctx, err) => console.error('server_error', err));
  // The device grant's polling interval (RFC 8628 §3.2; 5 s when absent, as this library leaves
  // it): 1 s, so that a `torchyard login` of the tests sees the sign-in within a second.
  provider.use(async (ctx, next) => {
    await next();
    if (ctx.path === '/device/auth' && ctx.status === 200 && ctx.body && typeof ctx.body === 'object') {
      ctx.body.interval = 1;
    }
  });
  return provider;
}

let provider = build();

const server = createServer((req, res) => {
  if (req.url === '/__test/config' && req.method === 'POST') {
    let body = '';
    req.on('data', (chunk) => (body += chunk));
    req.on('end', () => {
      try {
        Object.assign(config, JSON.parse(body));
        provider = build();
        res.writeHead(204).end();
      } catch (err) {
        res.writeHead(400).end(String(err));
      }
    });
    return;
  }
  provider.callback()(req, res);
});
server.listen(Number(port), '127.0.0.1', () => console.log('listening'));

// Calls to the service's /v1 routes, signed in by the HttpOnly session cookie.
// Every write carries the CSRF header the service requires of cookie-signed writes.

export const CSRF_HEADER = "X-Torchyard-CSRF";

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || `HTTP ${status}`);
    this.status = status;
    this.body = body || {};
    this.code = this.body.code;
  }

  // [{field, message}] for each bad field a 422 (or a domain error's details) names.
  fieldErrors() {
    const out = [];
    for (const e of this.body.errors || []) {
      if (e.field) out.push({ field: e.field, message: e.message + (e.allowed ? ` (allowed: ${e.allowed})` : "") });
    }
    const details = this.body.details;
    for (const d of Array.isArray(details) ? details : details ? [details] : []) {
      if (d && d.field) out.push({ field: d.field, message: d.message || this.message });
    }
    return out;
  }
}

async function parse(response) {
  const text = await response.text();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    return { message: text };
  }
}

export async function api(path, { method = "GET", json, form, signal } = {}) {
  const headers = { Accept: "application/json" };
  let body;
  if (method !== "GET" && method !== "HEAD") headers[CSRF_HEADER] = "1";
  if (form !== undefined) body = form;
  else if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = typeof json === "string" ? json : JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal, credentials: "same-origin" });
  const data = await parse(response);
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// A multipart upload with progress (fetch cannot report upload progress).
export function upload(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    xhr.setRequestHeader(CSRF_HEADER, "1");
    xhr.upload.onprogress = (e) => {
      if (e.lengthComputable) onProgress(e.loaded, e.total);
    };
    xhr.onload = () => {
      let data = null;
      try {
        data = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch {
        data = { message: xhr.responseText };
      }
      if (xhr.status >= 200 && xhr.status < 300) resolve(data);
      else reject(new ApiError(xhr.status, data));
    };
    xhr.onerror = () => reject(new ApiError(0, { message: "the upload failed (network error)" }));
    xhr.send(form);
  });
}

// Follow a text stream (logs?follow=true); calls onText per chunk until it ends or is aborted.
export async function followText(path, onText, signal) {
  const response = await fetch(path, { signal, credentials: "same-origin" });
  if (!response.ok) throw new ApiError(response.status, await parse(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    onText(decoder.decode(value, { stream: true }));
  }
  onText(decoder.decode());
}

// Integers beyond 2^53 (random_seed) lose digits as JS numbers: they are written as the
// digits the user typed.
export function jsonWithIntegers(value) {
  const marks = [];
  const text = JSON.stringify(value, (_key, v) => {
    if (v && typeof v === "object" && v.__int !== undefined) {
      marks.push(v.__int);
      return `__int_${marks.length - 1}__`;
    }
    return v;
  });
  return text.replace(/"__int_(\d+)__"/g, (_m, i) => marks[Number(i)]);
}

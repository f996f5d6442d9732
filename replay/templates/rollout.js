(function () {
  'use strict';
  var data = JSON.parse(document.getElementById('token-data').textContent);
  var panel = document.getElementById('tokens');
  var text = document.getElementById('token-text');
  var hover = document.getElementById('token-hover');
  var title = document.getElementById('token-title');
  var mode = 'logprob';
  var current = null;
  var palette = ['#1565c0', '#c62828', '#2e7d32', '#6a1b9a', '#ef6c00', '#00838f', '#5d4037', '#ad1457'];

  function jump(id) {
    var target = document.getElementById(id);
    if (!target) { return; }
    var closed = target.closest('details');
    if (closed) { closed.open = true; }
    target.scrollIntoView({block: 'center'});
    target.classList.add('flash');
    setTimeout(function () { target.classList.remove('flash'); }, 1400);
  }
  document.querySelectorAll('[data-target]').forEach(function (el) {
    el.addEventListener('click', function () { jump(el.getAttribute('data-target')); });
    el.addEventListener('keydown', function (e) {
      if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); jump(el.getAttribute('data-target')); }
    });
  });

  function colour(token) {
    if (mode === 'attempt') { return palette[(token[3] - 1) % palette.length]; }
    if (mode === 'policy') { return palette[token[4] % palette.length]; }
    return null;
  }
  function draw() {
    if (current === null) { return; }
    var call = data.calls[current];
    text.textContent = '';
    var frag = document.createDocumentFragment();
    call.tokens.forEach(function (token, i) {
      var span = document.createElement('span');
      span.textContent = data.pieces[token[1]];
      span.setAttribute('data-i', String(i));
      var lp = token[2];
      if (lp === null) {
        span.className = 'prompt';
      } else {
        var p = Math.exp(lp);
        span.className = 'sampled';
        span.style.background = 'hsl(' + Math.round(120 * p) + ',70%,80%)';
      }
      var c = colour(token);
      if (c) { span.style.borderBottomColor = c; }
      frag.appendChild(span);
    });
    text.appendChild(frag);
    title.textContent = call.call_id + ' · turn ' + call.turn + ' · ' + call.tokens.length + ' new tokens (' +
      call.prompt_new + ' prompt, ' + (call.tokens.length - call.prompt_new) + ' sampled) after ' + call.prefix_len +
      ' from its parent · ' + call.policy + ' · temperature ' + call.sampling.temperature + ', top_p ' +
      call.sampling.top_p + ', seed ' + call.sampling.seed + ' · ' + call.finish_reason;
  }
  text.addEventListener('mouseover', function (e) {
    var i = e.target.getAttribute && e.target.getAttribute('data-i');
    if (i === null || current === null) { return; }
    var token = data.calls[current].tokens[Number(i)];
    hover.textContent = 'token ' + token[0] + ' ' + JSON.stringify(data.pieces[token[1]]) +
      (token[2] === null ? ' · prompt (not sampled)' : ' · logprob ' + token[2].toFixed(4) + ' (p ' + Math.exp(token[2]).toFixed(3) + ')') +
      ' · attempt ' + token[3] + ' · turn ' + token[5] + ' · policy ' + data.policies[token[4]];
  });
  function open(index) {
    current = index;
    panel.classList.add('open');
    draw();
    document.body.setAttribute('data-tokens-shown', String(text.children.length));
  }
  document.querySelectorAll('button.tok[data-call]').forEach(function (b) {
    b.addEventListener('click', function () { open(Number(b.getAttribute('data-call'))); });
  });
  document.querySelectorAll('input[name=colour]').forEach(function (r) {
    r.addEventListener('change', function () { mode = r.value; draw(); });
  });
  document.getElementById('token-close').addEventListener('click', function () { panel.classList.remove('open'); });
  document.body.setAttribute('data-ready', String(document.querySelectorAll('[data-target]').length));
})();
